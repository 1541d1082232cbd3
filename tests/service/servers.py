"""Real `zen-mla serve` processes on loopback (or on a Unix socket) for the service tests, and
waiting on them.

Starting one takes seconds, so a test that does is marked slow: through a fixture made with
`server_fixture` (conftest.py marks every test that uses one, directly or through another
fixture), or by hand where it calls `serve()` itself. `serve()` refuses to start a server for a
test that is not marked slow, so the fast tier can never start one by mistake."""

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
F = TypeVar("F", bound=Callable[..., Any])

#: the names of the fixtures that start a server (`server_fixture`)
SERVER_FIXTURES: set[str] = set()
#: whether the test being run may start a server: it is marked slow (set by conftest.py)
running_slow = True


def server_fixture(**kwargs: Any) -> Callable[[F], F]:
    """`pytest.fixture(**kwargs)` for a fixture that starts a server: the tests that use it are
    marked slow (conftest.py)."""

    def wrap(fn: F) -> F:
        SERVER_FIXTURES.add(fn.__name__)
        return pytest.fixture(**kwargs)(fn)  # type: ignore[no-any-return]

    return wrap


def check_slow() -> None:
    """Raise unless the running test is marked slow (every server start calls this)."""
    if not running_slow:
        raise RuntimeError(
            "this test starts a server but is not marked slow: mark it @pytest.mark.slow, or "
            "take the server from a fixture made with server_fixture"
        )


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
    tmp: Path,
    *,
    uds: bool = False,
    nofile: tuple[int, int] | None = None,
    port: int | None = None,
    log: Path | None = None,
    **settings: object,
) -> Iterator[Server]:
    """`zen-mla serve` with `settings` as ZEN_MLA_* variables; `nofile`: its (soft, hard)
    RLIMIT_NOFILE; `port`: a port of the caller's (default: a free one); `log`: the file its
    output is appended to (default tmp/server.log)."""
    check_slow()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEN_MLA_")}
    env |= {f"ZEN_MLA_{k.upper()}": str(v) for k, v in settings.items()}
    args = [sys.executable, "-c", "from service.cli import main; main()", "serve"]
    if uds:
        path = str(tmp / "zen-mla.sock")
        args += ["--uds", path]
        url = "http://zen-mla"
    else:
        port = port or free_port()
        args += ["--port", str(port)]
        url, path = f"http://127.0.0.1:{port}", None
    log = log or tmp / "server.log"
    with log.open("ab") as out:
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


def busy_worker(server: Server, timeout: float = 60) -> dict:
    """`/health`'s entry for a worker once one is busy: it holds a task (stopped or killed from
    now on, the task is lost with it, not still waiting in a queue)."""
    deadline = time.monotonic() + timeout
    while True:
        workers = server.health()["workers"]
        busy = [w for w in workers if w["state"] == "busy"]
        if busy:
            return busy[0]
        assert time.monotonic() < deadline, f"no worker took the work within {timeout} s: {workers}"
        time.sleep(0.02)


def wait_draining(server: Server, timeout: float = 10) -> None:
    """Until `/health` says the server is draining: it has handled the SIGTERM sent it (the
    signal's handler sets the flag the compute routes read)."""
    deadline = time.monotonic() + timeout
    while (health := server.health())["status"] != "draining":
        assert time.monotonic() < deadline, f"not draining {timeout} s after SIGTERM: {health}"
        time.sleep(0.02)
