"""Real `zen-mla serve` processes on loopback (or on a Unix socket) for the service tests, and
waiting on them; started and waited on as the benchmarks start theirs (bench/_server.py).

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
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from bench._server import free_port, launch, wait_started
from tests.processes import wait_for

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


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    uds: str | None = None
    grpc_port: int | None = None  # where `grpc_port` was given

    @property
    def grpc_target(self) -> str:
        """host:port of its gRPC server."""
        assert self.grpc_port, "started without grpc_port"
        return f"127.0.0.1:{self.grpc_port}"

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
    output is appended to (default tmp/server.log). gRPC is off unless `grpc_port` is given."""
    check_slow()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEN_MLA_")}
    env |= {f"ZEN_MLA_{k.upper()}": str(v) for k, v in settings.items()}
    if uds:
        path = str(tmp / "zen-mla.sock")
        where = ["--uds", path]
        url = "http://zen-mla"
    else:
        port = port or free_port()
        where = ["--port", str(port)]
        url, path = f"http://127.0.0.1:{port}", None
    log = log or tmp / "server.log"
    with log.open("ab") as out:
        limit = (
            None
            if nofile is None
            else functools.partial(resource.setrlimit, resource.RLIMIT_NOFILE, nofile)
        )
        process = launch(where, env, out, limit)
    server = Server(url, process, log, path, int(str(settings.get("grpc_port", 0))) or None)
    try:
        wait_started(process, url, path, logs=server.logs)
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

    def ready() -> dict | None:
        health = server.health()
        alive = all(w["alive"] for w in health["workers"])
        return health if health["status"] == "ok" and alive else None

    return wait_for(ready, timeout, lambda: f"not ready within {timeout} s: {server.health()}", 0.1)


def busy_worker(server: Server, timeout: float = 60) -> dict:
    """`/health`'s entry for a worker once one is busy: it holds a task (stopped or killed from
    now on, the task is lost with it, not still waiting in a queue)."""

    def busy() -> dict | None:
        return next((w for w in server.health()["workers"] if w["state"] == "busy"), None)

    return wait_for(
        busy,
        timeout,
        lambda: f"no worker took the work within {timeout} s: {server.health()['workers']}",
        0.02,
    )


def wait_draining(server: Server, timeout: float = 10) -> None:
    """Until `/health` says the server is draining: it has handled the SIGTERM sent it (the
    signal's handler sets the flag the compute routes read)."""
    wait_for(
        lambda: server.health()["status"] == "draining",
        timeout,
        lambda: f"not draining {timeout} s after SIGTERM: {server.health()}",
        0.02,
    )
