"""The service as the benchmarks and the service tests start it: `zen-mla serve` in a process
of its own, on a free loopback port (or a Unix socket), waited on until `/health` says ok (on
the CPUs a benchmark gives it: `start_server`); and the Server-Timing parts of its answers.
Runtime dependencies only (no tritonclient, no pytest): every benchmark that needs a server
imports it from here, and tests/service/servers.py starts its servers with `launch` and
`wait_started`."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx

from tests.processes import wait_for

ROOT = Path(__file__).resolve().parent.parent
SERVE = (sys.executable, "-c", "from service.cli import main; main()", "serve")


def free_port() -> int:
    """A loopback port no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    where: list[str],
    env: dict[str, str],
    out: int | IO[bytes] = subprocess.DEVNULL,
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.Popen[bytes]:
    """`zen-mla serve` of this checkout at `where` (`--port N` or `--uds PATH`), in `env`, its
    output (stdout and stderr) to `out`; not waited on (`wait_started`). Without gRPC unless
    `where` or `env` names its port (the default, 8001, would be one port for every server)."""
    if "--grpc-port" not in where and "ZEN_MLA_GRPC_PORT" not in env:
        where = [*where, "--grpc-port", "0"]
    return subprocess.Popen(
        [*SERVE, *where],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        preexec_fn=preexec_fn,
    )


def ready(url: str, uds: str | None = None) -> bool:
    """Whether `/health` at `url` (through the Unix socket `uds`, where given) says ok now."""
    if uds is not None and not os.path.exists(uds):
        return False  # not yet: httpcore leaks the socket of a failed Unix connect
    transport = httpx.HTTPTransport(uds=uds) if uds else None
    try:
        with httpx.Client(transport=transport, timeout=10) as client:
            return bool(client.get(url + "/health").json()["status"] == "ok")
    except (httpx.HTTPError, OSError, ValueError):
        return False


def wait_started(
    process: subprocess.Popen[bytes],
    url: str,
    uds: str | None = None,
    timeout: float = 180,
    logs: Callable[[], str] = lambda: "",
) -> None:
    """Returns once `process`, a `zen-mla serve` at `url`, says ok on `/health`; an
    AssertionError with its `logs()` where it exits first or is not ready within `timeout`."""

    def up() -> bool:
        assert process.poll() is None, f"server exited:\n{logs()}"
        return ready(url, uds)

    wait_for(up, timeout, lambda: f"server not ready within {timeout} s:\n{logs()}", step=0.2)


def start_server(
    http: str,
    uds: str | None = None,
    system_shm: bool = False,
    cpus: tuple[int, ...] | None = None,
    settings: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """`zen-mla serve` (on `cpus` only, where given: its workers find those), ready; `settings`
    as ZEN_MLA_<NAME> variables."""
    port = free_port()
    env = dict(
        os.environ,
        ZEN_MLA_HTTP=http,
        ZEN_MLA_MAX_BODY_BYTES=str(1 << 30),
        ZEN_MLA_LOG_LEVEL="warning",
        ZEN_MLA_SYSTEM_SHM="true" if system_shm else "false",
    )
    env |= {f"ZEN_MLA_{k.upper()}": v for k, v in (settings or {}).items()}
    proc = launch(
        ["--uds", uds] if uds else ["--port", str(port)],
        env,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    url = "http://zen-mla" if uds else f"http://127.0.0.1:{port}"
    try:
        wait_started(proc, url, uds)
    except AssertionError as exc:
        proc.kill()
        raise RuntimeError(f"server ({http}) did not start: {exc}") from None
    return proc, url


def server_timing(response: httpx.Response) -> dict[str, float]:
    out = {}
    for part in response.headers.get("server-timing", "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur) / 1e3
    return out


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds spent so far by the service whose main process is `pid`, summed over threads
    (`/proc/<pid>/task/*/schedstat`, ns resolution, where `stat`'s ticks are 10 ms): "server"
    (the main process: its event loop, the pool's dispatcher and readers) and "workers" (every
    process under it: the pool's workers, multiprocessing's resource tracker). Linux only."""

    def own(p: int) -> float:
        total = 0
        for task in Path(f"/proc/{p}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that ended
                total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9

    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    below, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        below.append(p)
        todo.extend(children.get(p, []))
    workers = 0.0
    for p in below:
        with contextlib.suppress(OSError):  # a process that ended
            workers += own(p)
    return {"server": own(pid), "workers": workers}
