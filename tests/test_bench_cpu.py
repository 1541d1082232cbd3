"""`bench/_server.cpu_seconds`, which `bench/floor.py` splits a call's service CPU with: a
process's own threads count as "server", every process under it as "workers"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from bench._server import cpu_seconds
from tests.processes import wait_for

# a parent that sleeps in `subprocess.run` while its child spins for 3 s of CPU
PARENT = (
    "import subprocess, sys; "
    "subprocess.run([sys.executable, '-c', "
    "'import time; t = time.process_time()\\nwhile time.process_time() - t < 3: pass'])"
)


def test_the_cpu_of_processes_under_the_service_counts_as_workers():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    try:
        before = cpu_seconds(parent.pid)

        def counted() -> dict[str, float] | None:
            now = cpu_seconds(parent.pid)
            return now if now["workers"] - before["workers"] >= 0.3 else None

        now = wait_for(counted, 60, lambda: f"{before} then {cpu_seconds(parent.pid)}")
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and its child
        parent.wait(30)
    workers = now["workers"] - before["workers"]
    server = now["server"] - before["server"]  # the parent's start, then asleep
    assert server < workers / 3, (before, now)
