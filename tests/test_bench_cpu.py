"""`bench/_server.cpu_seconds`, which `bench/floor.py` splits a call's service CPU with: a
process's own threads count as "server", every process under it as "workers"."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# loaded from its file: bench/ on sys.path would shadow names (kernel, pool) for every test
_spec = importlib.util.spec_from_file_location(
    "bench_server", Path(__file__).resolve().parents[1] / "bench" / "_server.py"
)
assert _spec is not None and _spec.loader is not None
_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_server)
cpu_seconds = _server.cpu_seconds

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
