"""The service as the benchmarks start it: `zen-mla serve` in a process of its own, on a free
loopback port (or a Unix socket), on the CPUs a benchmark gives it; and the Server-Timing parts of
its answers. Runtime dependencies only (no tritonclient): every benchmark that needs a server
imports it from here."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def start_server(
    http: str,
    uds: str | None = None,
    system_shm: bool = False,
    cpus: tuple[int, ...] | None = None,
    settings: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """`zen-mla serve` (on `cpus` only, where given: its workers find those), ready; `settings`
    as ZEN_MLA_<NAME> variables."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = ["--uds", uds] if uds else ["--port", str(port)]
    env = dict(
        os.environ,
        ZEN_MLA_HTTP=http,
        ZEN_MLA_MAX_BODY_BYTES=str(1 << 30),
        ZEN_MLA_LOG_LEVEL="warning",
        ZEN_MLA_SYSTEM_SHM="true" if system_shm else "false",
    )
    env |= {f"ZEN_MLA_{k.upper()}": v for k, v in (settings or {}).items()}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from service.cli import main; main()",
            "serve",
            *where,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    url = "http://zen-mla" if uds else f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if uds is None or os.path.exists(uds):
            try:
                transport = httpx.HTTPTransport(uds=uds) if uds else None
                with httpx.Client(transport=transport, timeout=2) as client:
                    if client.get(url + "/health").json()["status"] == "ok":
                        return proc, url
            except (httpx.HTTPError, ValueError):
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server ({http}) did not start")


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
