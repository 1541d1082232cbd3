"""Real `zen-mla serve` processes on loopback (or on a Unix socket) for the service tests, and
waiting on them."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    uds: str | None = None

    def client(self, **kwargs: object) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        return httpx.Client(base_url=self.url, transport=transport, timeout=120, **kwargs)  # type: ignore[arg-type]

    def health(self) -> dict:
        with self.client() as c:
            return c.get("/health").json()

    def logs(self) -> str:
        return self.log.read_text()


@contextlib.contextmanager
def serve(
    tmp: Path, *, uds: bool = False, nofile: tuple[int, int] | None = None, **settings: object
) -> Iterator[Server]:
    """`zen-mla serve` with `settings` as ZEN_MLA_* variables; `nofile`: its (soft, hard)
    RLIMIT_NOFILE."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEN_MLA_")}
    env |= {f"ZEN_MLA_{k.upper()}": str(v) for k, v in settings.items()}
    args = [sys.executable, "-c", "from service.cli import main; main()", "serve"]
    if uds:
        path = str(tmp / "zen-mla.sock")
        args += ["--uds", path]
        url = "http://zen-mla"
    else:
        port = free_port()
        args += ["--port", str(port)]
        url, path = f"http://127.0.0.1:{port}", None
    log = tmp / "server.log"
    with log.open("wb") as out:
        limit = (
            None
            if nofile is None
            else functools.partial(resource.setrlimit, resource.RLIMIT_NOFILE, nofile)
        )
        process = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit
        )
    server = Server(url, process, log, path)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"server exited:\n{server.logs()}"
            assert time.monotonic() < deadline, f"server not ready:\n{server.logs()}"
            if path is not None and not os.path.exists(path):
                time.sleep(0.2)  # httpcore leaks the socket of a failed Unix connect
                continue
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


def wait_ready(server: Server, timeout: float = 60) -> dict:
    """`/health` once it says ok with every worker alive (after a worker was replaced)."""
    deadline = time.monotonic() + timeout
    while True:
        health = server.health()
        if health["status"] == "ok" and all(w["alive"] for w in health["workers"]):
            return health
        assert time.monotonic() < deadline, health
        time.sleep(0.1)
