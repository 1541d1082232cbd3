"""Guards under uvicorn's HTTP parsers (httptools and h11 alike), before a request reaches the app.

- a cap on open connections: at the cap, a new connection takes the place of the connection
  that has waited longest without a request in flight (idle, or its head still coming: it is
  answered 408 and closed; or lingering after its answer: closed); with none such, it is
  answered 503 and closed;
- a cap on the request line and headers: 431, checked before bytes are handed to the parser
  (httptools has no limit of its own: a 128 MiB header took 20 s to parse and stalled others);
- a header timeout: a connection that has not delivered a request's headers within it, from
  its start or from the last answer, is answered 408 and closed (idle and slowloris clients);
- a cut: each request's scope carries the connection's `cut` (`answer.CUT`), which aborts it,
  dropping what the transport holds (an answer its client stopped reading);
- a lingering close: when a connection closes with request bytes still coming (an early 413,
  503, 408, 431, or a client that sent `Connection: close`), the answer is followed by a FIN
  and the input is read and dropped for a bounded time and size before the socket closes.
  Closing with unread input makes the kernel send a reset, and a reset makes the client's
  kernel drop the answer it had not read yet (seen: ConnectionResetError instead of 413).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from zen_mla import (
    HeadersTooLargeError,
    RequestTimeoutError,
    ServiceUnavailableError,
    ZenMLAError,
)

from .answer import CUT
from .problems import problem_bytes

__all__ = ["REFUSALS_ANSWERED", "ConnectionLimits", "protocol_class"]

# Connections over the cap are answered 503 (and linger) up to this many at a time; beyond,
# they are closed at once, so that a flood of them cannot use up the descriptors kept in reserve.
REFUSALS_ANSWERED = 64


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int
    max_header_bytes: int
    header_timeout_s: float
    linger_s: float
    linger_bytes: int


class _Guarded(asyncio.Protocol):
    """Mixed in before a uvicorn protocol; every attribute below but `limits` is uvicorn's."""

    limits: ClassVar[ConnectionLimits]
    # Connections without a request in flight, longest waiting first (a dict keeps insertion
    # order). Owner: the event loop's thread, where every protocol callback runs.
    idle: ClassVar[dict[_Guarded, None]]
    transport: asyncio.Transport
    connections: Any
    cycle: Any
    loop: asyncio.AbstractEventLoop
    app: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._real = cast(asyncio.Transport, transport)
        app = self.app

        async def with_cut(scope: Any, receive: Any, send: Any) -> None:
            scope[CUT] = self.cut
            await app(scope, receive, send)

        self.app = with_cut
        self._head_bytes = 0  # bytes of the request head being read, so far
        self._lingering = False
        self._dropped = 0
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for: object = None
        super().connection_made(_LingeringTransport(self._real, self))
        over = len(self.connections) - self.limits.max_connections
        if over > 0 and self._displace_idle():
            over = 0
        if over > REFUSALS_ANSWERED:  # a flood: lingering would hold a descriptor for each
            self._lingering = True
            self._real.close()
            return
        if over > 0:
            n = self.limits.max_connections
            self.refuse(ServiceUnavailableError(f"{n} connections are open (the cap)", 1))
            return
        self.arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.idle.pop(self, None)
        super().connection_lost(exc)

    def _displace_idle(self) -> bool:
        """Close the connection that has waited longest with no request in flight, for this
        one; False when there is none."""
        while self.idle:
            oldest = next(iter(self.idle))
            del self.idle[oldest]
            if oldest is self or oldest._real.is_closing():
                continue
            if oldest._lingering:  # answered already: only its close was pending
                oldest._real.close()
                return True
            t = self.limits.header_timeout_s
            oldest._real.write(
                problem_bytes(
                    RequestTimeoutError(
                        "no request came on this connection while others waited for one "
                        f"(the connection cap is reached; idle ones are closed, at most {t} s)"
                    )
                )
            )
            oldest._lingering = True  # nothing more goes to the parser
            oldest._cancel_timer()
            oldest._real.close()
            return True
        return False

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._dropped += len(data)
            if self._dropped > self.limits.linger_bytes:
                self._real.close()
            return
        if not self.awaiting_head():
            super().data_received(data)
            return
        room = self.limits.max_header_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            if not self.awaiting_head():
                self._head_bytes = 0
                self.idle.pop(self, None)  # a request is in flight
            return
        # Only as much as the cap allows goes to the parser; the rest only if the head ended.
        super().data_received(data[:room])
        if self._lingering or self._real.is_closing():
            return
        if self.awaiting_head():
            cap = self.limits.max_header_bytes
            self.refuse(
                HeadersTooLargeError(
                    f"request line and headers: expected at most {cap} bytes, got more"
                )
            )
            return
        self._head_bytes = 0
        self.idle.pop(self, None)
        self.data_received(data[room:])

    def awaiting_head(self) -> bool:
        raise NotImplementedError

    def unread_input(self) -> bool:
        """Whether request bytes may still be on their way (closing now would reset)."""
        cycle = self.cycle
        partial_head = self._head_bytes > 0 and self.awaiting_head()
        return partial_head or (cycle is not None and cycle.more_body and not cycle.disconnected)

    def arm_header_timer(self) -> None:
        """From now on the connection waits for a request: its headers must come in time, and
        it may be displaced at the connection cap."""
        self._cancel_timer()
        self.idle.pop(self, None)
        self.idle[self] = None
        self._armed_for = self.cycle
        self._timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        self._timer = None
        cycle: Any = self.cycle
        # No request's headers completed since arming, and none is being answered (a pipelined
        # one may have started when the timer was armed: its answer re-arms the timer).
        answering = cycle is not None and not cycle.response_complete
        if cycle is self._armed_for and not answering:
            t = self.limits.header_timeout_s
            self.refuse(RequestTimeoutError(f"the request headers did not arrive within {t} s"))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def cut(self) -> None:
        """Abort the connection: what it has not sent is dropped, nothing more is read."""
        self._lingering = True
        self._cancel_timer()
        self._real.abort()

    def refuse(self, exc: ZenMLAError) -> None:
        """Answer `exc` as problem+json on the connection itself, and close it lingering."""
        if self._lingering or self._real.is_closing():
            return
        self._real.write(problem_bytes(exc))
        self.linger()

    def linger(self) -> None:
        """FIN after what was written; drop input until the client closes, or `linger_s`, or
        `linger_bytes`; then close."""
        if self._lingering:
            return
        self._lingering = True
        self._cancel_timer()
        self.idle.pop(self, None)
        self.idle[self] = None  # answered: its place may go to a new connection at the cap
        real = self._real
        if real.is_closing():
            return
        if self.limits.linger_s <= 0 or not real.can_write_eof():
            real.close()
            return
        real.write_eof()
        real.resume_reading()
        self._timer = self.loop.call_later(self.limits.linger_s, real.close)


class _LingeringTransport(asyncio.Transport):
    """What uvicorn's protocol and its request cycles hold: the real transport, except that
    `close()` lingers while request bytes may still come."""

    def __init__(self, real: asyncio.Transport, protocol: _Guarded) -> None:
        super().__init__()
        self._real = real
        self._protocol = protocol

    def close(self) -> None:
        if self._protocol.unread_input():
            self._protocol.linger()
        else:
            self._real.close()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._real.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._real.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self._real.writelines(list_of_data)

    def write_eof(self) -> None:
        self._real.write_eof()

    def can_write_eof(self) -> bool:
        return self._real.can_write_eof()

    def abort(self) -> None:
        self._real.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._real.get_extra_info(name, default)

    def pause_reading(self) -> None:
        if not self._protocol._lingering:
            self._real.pause_reading()

    def resume_reading(self) -> None:
        self._real.resume_reading()

    def is_reading(self) -> bool:
        return self._real.is_reading()

    def get_write_buffer_size(self) -> int:
        return self._real.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._real.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._real.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._real.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._real.get_protocol()


class GuardedHttpToolsProtocol(_Guarded, HttpToolsProtocol):
    _head_pending = True

    def awaiting_head(self) -> bool:
        return self._head_pending

    def on_headers_complete(self) -> None:
        self._head_pending = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_pending = True
        self._head_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.arm_header_timer()


class GuardedH11Protocol(_Guarded, H11Protocol):
    def awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.arm_header_timer()


def protocol_class(http: str, limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's protocol for `http` ("httptools" or "h11") with these limits."""
    base: type[_Guarded] = GuardedHttpToolsProtocol if http == "httptools" else GuardedH11Protocol
    return type(base.__name__, (base,), {"limits": limits, "idle": {}})
