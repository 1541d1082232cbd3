"""A `zen-mla serve` on a port of the caller's choosing, so that a client can lose it and find it
again at the same URL (tests/service/servers.py picks a new port for each server)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tests.processes import eventually
from tests.service.servers import Server, serve


@contextlib.contextmanager
def serve_on(port: int, log: Path, workers: int = 1) -> Iterator[Server]:
    """A server on 127.0.0.1:`port` once /health says ok, its output appended to `log` (a
    server started again on the port writes on); stopped when the block ends, unless it is
    gone by then."""
    with serve(log.parent, port=port, log=log, workers=workers) as server:
        yield server


def kill(server: Server) -> None:
    """SIGKILL, as an outage: no draining, no goodbye."""
    server.process.kill()
    server.process.wait()


def requests_counted(
    server: Server, routes: tuple[str, ...] = ("prefill", "socket"), status: int | None = 200
) -> int:
    """The service's own count of prefill calls answered `status` (None: any) on `routes`
    (/metrics): over HTTP (`/prefill`) and on the region socket (same host). A call is counted
    when its handler ends (a streamed answer may still be on its way; a client gone is a
    499)."""
    with server.client() as c:
        text = c.get("/metrics").text
    counted = 0
    for route in routes:
        prefix = f'zen_mla_requests_total{{route="{route}",status="'
        for line in text.splitlines():
            if line.startswith(prefix):
                code, _, n = line[len(prefix) :].partition('"} ')
                if status is None or code == str(status):
                    counted += int(float(n))
    return counted


def requests_answered(
    server: Server,
    at_least: int = 0,
    routes: tuple[str, ...] = ("prefill", "socket"),
    timeout: float = 10.0,
) -> int:
    """`requests_counted` of 200s once it reaches `at_least` or `timeout` passed: a call its
    worker answered is counted when the service reads the worker's Done, just after the client
    has its reply."""
    eventually(lambda: requests_counted(server, routes) >= at_least, timeout, 0.02)
    return requests_counted(server, routes)
