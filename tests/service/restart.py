"""A `zen-mla serve` on a port of the caller's choosing, so that a client can lose it and find it
again at the same URL (tests/service/servers.py picks a new port for each server)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.service.servers import ROOT, Server, check_slow


@contextlib.contextmanager
def serve_on(port: int, log: Path, workers: int = 1) -> Iterator[Server]:
    """A server on 127.0.0.1:`port` once /health says ok; SIGTERM (SIGKILL after 30 s) when
    the block ends, unless it is gone by then."""
    check_slow()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEN_MLA_")}
    args = [sys.executable, "-c", "from service.cli import main; main()", "serve"]
    args += ["--port", str(port), "--workers", str(workers)]
    with log.open("ab") as out:
        process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"server exited:\n{server.logs()}"
            assert time.monotonic() < deadline, f"server not ready:\n{server.logs()}"
            try:
                if server.health()["status"] == "ok":
                    break
            except (httpx.HTTPError, OSError, ValueError):
                pass
            time.sleep(0.2)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def kill(server: Server) -> None:
    """SIGKILL, as an outage: no draining, no goodbye."""
    server.process.kill()
    server.process.wait()


def requests_answered(server: Server) -> int:
    """The service's own count of /prefill requests answered 200 (/metrics)."""
    with server.client() as c:
        text = c.get("/metrics").text
    for line in text.splitlines():
        if line.startswith('zen_mla_requests_total{route="prefill",status="200"}'):
            return int(float(line.split()[-1]))
    return 0
