"""What a gRPC call is held to before its method runs, beyond the limits grpc's transport keeps
itself (`grpc_server.grpc_options`: message size, streams per connection, connections):

- its caller's place among the calls open (`Admission.open_call`, `grpc_max_calls` shared as
  the queue is): a call past its caller's share is RESOURCE_EXHAUSTED before its message is
  read, whatever its method;
- its connection's resets: a connection whose calls its caller cancels within `PREMATURE_S` of
  opening them, `grpc_max_resets` of them and more than half of its calls, is closed (HTTP/2
  rapid reset: each such call costs a handler run here for one frame there; grpc core refuses
  streams past `grpc_max_streams` but keeps the connection).

grpc offers Python no way to close one connection (a server's context knows its call, not its
transport), so the connection's socket is found among this process's descriptors by its two
ends and shut down: grpc core sees the connection end and closes it, the caller gets a
connection error, and the other connections go on."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..admission import Admission
from ..doors import GrpcDoor, peer_address
from ..settings import Settings

__all__ = ["PREMATURE_S", "CallLimits", "close_connection"]

log = logging.getLogger("zen_mla.service")

#: a call its caller cancels sooner than this after it opened counts as a reset
PREMATURE_S = 1.0
#: connections remembered with no call open, beyond the gRPC connection cap, before the oldest
#: of them are forgotten
SPARE_CONNECTIONS = 64


@dataclass
class _Connection:
    calls: int = 0  # calls opened on it
    resets: int = 0  # of those, cancelled by the caller within PREMATURE_S
    open: int = 0  # calls open now
    closed: bool = False


class CallLimits:
    """Every gRPC call's place among the calls open, and each connection's resets. Owner: the
    event loop's thread (handlers only)."""

    def __init__(self, admission: Admission, settings: Settings, connections: int) -> None:
        self.admission = admission
        self.max_resets = settings.grpc_max_resets
        self.port = settings.grpc_port
        self.remembered = connections + SPARE_CONNECTIONS
        # by peer (address and port: one connection), oldest first
        self.connections: dict[str, _Connection] = {}

    @contextlib.contextmanager
    def held(self, door: GrpcDoor) -> Iterator[None]:
        """The call's place, from here to the end of the `with` (QueueFullError where its
        caller's share is used up); a cancel from its caller (grpc cancels the handler) within
        `PREMATURE_S` counts against its connection, which is closed past the bound."""
        self.admission.open_call(door.caller)
        conn = self._connection(door.peer)
        conn.calls += 1
        conn.open += 1
        start = time.monotonic()
        try:
            yield
        except asyncio.CancelledError:
            if time.monotonic() - start < PREMATURE_S:
                conn.resets += 1
                self._judge(door.peer, conn)
            raise
        finally:
            conn.open -= 1
            self.admission.close_call(door.caller)

    def _connection(self, peer: str) -> _Connection:
        conn = self.connections.get(peer)
        if conn is None:
            conn = self.connections[peer] = _Connection()
            if len(self.connections) > self.remembered:
                self._forget()
        return conn

    def _forget(self) -> None:
        """Forget the connections with no call open, oldest first, down to the cap (a closed
        connection is never told of; its caller's next has another port)."""
        idle = [peer for peer, conn in self.connections.items() if conn.open == 0]
        for peer in idle[: len(self.connections) - self.remembered + SPARE_CONNECTIONS // 2]:
            del self.connections[peer]

    def _judge(self, peer: str, conn: _Connection) -> None:
        if conn.closed or conn.resets < self.max_resets or 2 * conn.resets <= conn.calls:
            return
        conn.closed = True
        found = close_connection(peer, self.port)
        log.warning(
            "gRPC: %s cancelled %d of its %d calls within %.0f s of opening them; its connection "
            "%s",
            peer,
            conn.resets,
            conn.calls,
            PREMATURE_S,
            "is closed" if found else "was not found to close",
        )


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an address, an IPv4 address mapped into IPv6 as the IPv4 one."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def close_connection(peer: str, port: int) -> bool:
    """Shut down this process's TCP connection on local `port` whose far end is `peer` (a gRPC
    peer string); False where there is none. The descriptor stays its owner's (grpc core's) to
    close: only its connection ends."""
    far = peer_address(peer)
    if far is None:
        return False
    host, far_port = _address(far[0]), far[1]
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))  # a duplicate, closed below
        except OSError:
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                here, there = sock.getsockname(), sock.getpeername()
            except OSError:  # not connected: a listener
                continue
            if here[1] == port and there[1] == far_port and _address(there[0]) == host:
                sock.shutdown(socket.SHUT_RDWR)
                return True
    return False
