"""uvicorn, with a drain on the first SIGTERM/SIGINT: new requests get 503 while in-flight ones
finish (up to the drain timeout), then the usual shutdown; a second signal exits at once. The
gRPC server (`kserve.grpc_server`) runs on uvicorn's event loop beside it."""

from __future__ import annotations

import logging
import resource
import socket
import time
from dataclasses import dataclass
from types import FrameType

import uvicorn

from .app import create_app
from .kserve.grpc_server import start_grpc
from .protocol import ConnectionLimits, protocol_class
from .settings import Settings
from .state import ServiceState

log = logging.getLogger("zen_mla.service")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServiceState, grpc_connections: int) -> None:
        super().__init__(config)
        self.state = state
        self.grpc_connections = grpc_connections  # gRPC's part of the connection budget
        self.drain_started: float | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's serving, with the gRPC server (`grpc_port`) on the same event loop: it
        listens before HTTP does and stops after it, its calls drained as HTTP's are."""
        grpc_server = None
        if self.state.settings.grpc_port:
            grpc_server = await start_grpc(self.state, self.grpc_connections)
            log.info("gRPC listening on port %d", self.state.settings.grpc_port)
        try:
            await super().serve(sockets)
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=5)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_started is None and not self.should_exit:
            # runs in a signal handler: set flags only, on_tick does the rest
            self.drain_started = time.monotonic()
            self.state.draining = True
            log.info("draining: %d requests in flight", self.state.inflight)
            return
        self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            waited = time.monotonic() - self.drain_started
            if self.state.inflight == 0 or waited > self.state.settings.drain_timeout_s:
                self.should_exit = True
        return await super().on_tick(counter)


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns the soft limit now.

    Connections, the pool's pipes and every shared buffer each hold a descriptor; the common
    default soft limit (1024) is far below what the hard limit allows.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # a container may forbid it: keep what we have
            log.warning("could not raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, exc)
    return soft


@dataclass(frozen=True, slots=True)
class ConnectionCaps:
    """The one connection budget, shared out: HTTP's cap (uvicorn's protocol, `protocol.py`)
    and gRPC's (grpc core's `grpc.max_allowed_incoming_connections`). Each connection holds a
    descriptor, and the two counts are kept apart (grpc core tells Python nothing of its
    connections), so each side has a fixed part and together they stay in the budget."""

    http: int
    grpc: int


def connection_caps(settings: Settings, fd_limit: int) -> ConnectionCaps:
    """`max_connections`, lowered so that `fd_reserve` descriptors stay for the pool, shared
    out: gRPC's part `grpc_max_connections`, at most half of it (none while gRPC is off), and
    HTTP's the rest."""
    budget = min(settings.max_connections, max(1, fd_limit - settings.fd_reserve))
    if budget < settings.max_connections:
        log.warning(
            "max_connections lowered from %d to %d: %d descriptors allowed, %d kept for the pool",
            settings.max_connections,
            budget,
            fd_limit,
            settings.fd_reserve,
        )
    if not settings.grpc_port:
        return ConnectionCaps(http=budget, grpc=0)
    grpc = max(1, min(settings.grpc_max_connections, budget // 2))
    return ConnectionCaps(http=max(1, budget - grpc), grpc=grpc)


def build_server(settings: Settings, fd_limit: int) -> DrainingServer:
    app = create_app(settings)
    caps = connection_caps(settings, fd_limit)
    limits = ConnectionLimits(
        max_connections=caps.http,
        max_header_bytes=settings.max_header_bytes,
        header_timeout_s=settings.header_timeout_s,
        linger_s=settings.linger_s,
        linger_bytes=settings.linger_bytes,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        uds=settings.uds,
        http=protocol_class(settings.http, limits),
        loop="uvloop",
        # A client is its peer: a forwarded address only from the proxies the operator names
        # (uvicorn trusts X-Forwarded-For from 127.0.0.1 unless told otherwise).
        proxy_headers=settings.forwarded_allow_ips is not None,
        forwarded_allow_ips=settings.forwarded_allow_ips or "",
        log_level=settings.log_level,
        # the pool drains itself; uvicorn's own wait only covers sending the last bytes
        timeout_graceful_shutdown=5,
        access_log=False,  # one structured line per request comes from the app instead
        # h11's own head limit answers 400; ours (protocol.py) answers 431 before it is reached
        h11_max_incomplete_event_size=2 * settings.max_header_bytes,
    )
    return DrainingServer(config, app.state.service, caps.grpc)
