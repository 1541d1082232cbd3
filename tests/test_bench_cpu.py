"""`bench/_server.cpu_seconds`, which `bench/floor.py` splits a call's service CPU with: a
process's own threads count as "server", every process under it as "workers"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _server import cpu_seconds

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
        deadline = time.monotonic() + 60
        while (now := cpu_seconds(parent.pid))["workers"] - before["workers"] < 0.3:
            assert time.monotonic() < deadline, (before, now)
            time.sleep(0.05)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and its child
        parent.wait(30)
    workers = now["workers"] - before["workers"]
    server = now["server"] - before["server"]  # the parent's start, then asleep
    assert server < workers / 3, (before, now)
