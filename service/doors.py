"""How a request came in, as the pipeline (`pipeline`) needs to know it (`Door`): who sent it
(the caller admission counts), whether its token is good, how many bytes it brings and whether
they are in already, and when its sender hangs up. Three doors: an HTTP request (`HttpDoor`),
whose body is still to come in ASGI messages; a prefill frame on the region socket (`CallDoor`),
whose bytes the socket's one frame reader read already; and a gRPC call (`GrpcDoor`), whose one
message grpc's transport reads whole."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, MutableMapping
from typing import Any, Protocol
from urllib.parse import unquote

from fastapi import Request
from starlette.requests import ClientDisconnect
from uvicorn.middleware.proxy_headers import _TrustedHosts

from zen_mla import (
    BodyTooLargeError,
    InvalidInputError,
    LengthRequiredError,
    UnauthorizedError,
    WireFormatError,
    deadline,
)
from zen_mla.caller import Caller

from .body import Receive
from .tenants import Tenants

__all__ = [
    "COPIES",
    "CallDoor",
    "Door",
    "GrpcDoor",
    "HttpDoor",
    "bearer",
    "byte_count",
    "peer_address",
    "trusted_proxies",
]

#: the copies of one gRPC message the process holds while grpc reads it: grpc core's buffers,
#: then a bytearray and bytes of them in grpc's Python layer (six 200 MiB messages peaked at
#: +602 MiB with one of them charged); once read, the message and its copy into the workers'
#: buffer, until the message is let go after decoding (`GrpcDoor.kept`)
COPIES = 3


class Door(Protocol):
    """A way in, as the pipeline uses it whichever it is.

    `caller`: who is charged (`authorize` may name a tenant instead).
    `body_size(limit)`: the bytes the request brings, refused above `limit` before any is read.
    `arrived()`: those bytes where the door holds them already, read by a reader of its own
    (charged as they are: no upload slot, no rate); None where they are still to come, by
    `receive` (ASGI messages, read by the pipeline's one body reader) or, where `whole`, by
    `read()` (one message, read whole by the door's transport: the pipeline admits it, with
    an upload slot, before awaiting it within the request's deadline). `gone()`: completes once
    the sender hangs up. `timeout()`: the seconds its caller gave it, where its transport
    carries them (`zen_mla.deadline`)."""

    caller: Caller
    whole: bool

    def authorize(self, tenants: Tenants) -> None:
        """The request's token checked, where one is required (UnauthorizedError otherwise);
        `caller` is then the tenant it names."""

    def body_size(self, limit: int) -> int:
        """The bytes the request brings, at most `limit` (BodyTooLargeError above it)."""

    def most(self, limit: int) -> int:
        """The most bytes reading the request may take in, for a body of at most `limit`:
        `limit` where the door's reader stops there; more where its transport reads a whole
        message up to a limit of its own, which admission holds for it before it is read."""

    def kept(self, nbytes: int) -> int:
        """What a request of `nbytes` read whole (`whole`) holds once read: charged until its
        inputs are let go."""

    def arrived(self) -> bytes | None:
        """The bytes, where they are in already; None: to be read from `receive`."""

    def receive(self) -> Awaitable[MutableMapping[str, Any]]:
        """The body's next ASGI message."""

    def read(self) -> Awaitable[bytes]:
        """The request's bytes, where they come whole (`whole`): awaited."""

    def gone(self) -> Awaitable[None]:
        """Completes once the sender hangs up."""

    def timeout(self) -> float | None:
        """The caller's seconds, from the request's head; None where it sent none."""


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (RFC 6750; the scheme in any
    case); None where the value is missing or of another scheme."""
    scheme, _, token = (authorization or "").partition(" ")
    return token if scheme.lower() == "bearer" else None


def byte_count(raw: str) -> int | None:
    """A header's byte count: ASCII digits only (str.isdigit() takes "²" and int() 5,000
    digits, both costly or fatal later), at most 18 of them; None otherwise."""
    raw = raw.strip()
    if not (0 < len(raw) <= 18 and raw.isascii() and raw.isdigit()):
        return None
    return int(raw)


class HttpDoor:
    """An HTTP request: its caller is the tenant its bearer token names, else the peer's address
    (a proxy's X-Forwarded-For only where the operator trusts that proxy: see `tenants`), its
    bytes the body its Content-Length announces."""

    whole = False

    def __init__(self, request: Request) -> None:
        self.request = request
        self.caller = Caller.of(request.client.host if request.client else None)
        self.receive: Receive = request.receive

    def authorize(self, tenants: Tenants) -> None:
        """The bearer token, where one is required (UnauthorizedError otherwise); the caller is
        the tenant it names, where tenants have tokens."""
        if not tenants.required:
            return
        tenant = tenants.caller(bearer(self.request.headers.get("authorization")))
        if tenant is not None:
            self.caller = tenant

    def content_length(self) -> int:
        """The body's announced size (LengthRequiredError where none is readable)."""
        raw = self.request.headers.get("content-length")
        n = None if raw is None else byte_count(raw)
        if n is None:
            got = "none" if raw is None else repr(raw[:40])
            raise LengthRequiredError(f"Content-Length: expected the body size in bytes, got {got}")
        return n

    def body_size(self, limit: int) -> int:
        """The body's announced size, at most `limit`: refused before a byte of it is read."""
        n = self.content_length()
        if n > limit:
            raise BodyTooLargeError(f"Content-Length: expected at most {limit} bytes, got {n}")
        return n

    def most(self, limit: int) -> int:
        """`limit`: the one body reader stops there."""
        return limit

    def kept(self, nbytes: int) -> int:
        return nbytes

    def arrived(self) -> None:
        """None: the body is still to come, by `receive`."""
        return None

    async def read(self) -> bytes:
        raise NotImplementedError("an HTTP body comes by receive")

    async def gone(self) -> None:
        """Returns once the client hangs up."""
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                return

    def timeout(self) -> float | None:
        """The `Zen-MLA-Timeout` header's seconds (InvalidInputError where it is no number)."""
        raw = self.request.headers.get(deadline.HEADER)
        return None if raw is None else deadline.timeout_of(raw, deadline.HEADER)


class CallDoor:
    """A prefill frame on the region socket: its caller is the tenant the socket's hello token
    named, else the peer's uid (SO_PEERCRED); its token was checked by that hello, its bytes are
    the frame's `body`, and the socket's end is `gone`."""

    whole = False

    def __init__(
        self,
        message: dict[str, Any],
        gone: asyncio.Future[None],
        uid: int | None,
        tenant: Caller | None = None,
    ) -> None:
        self.message = message
        self.caller = tenant if tenant is not None else Caller.of(uid)
        self._gone = gone
        self._body: bytes | None = None

    def authorize(self, tenants: Tenants) -> None:
        """Nothing to check: the socket's hello did."""

    def body(self) -> bytes:
        """The frame's `body`, a regions JSON request (at most the frame's cap: the socket's one
        reader read it), as bytes (encoded once)."""
        if self._body is None:
            body = self.message.get("body")
            if not isinstance(body, str):
                raise InvalidInputError(
                    "body", "the regions JSON request, as a string", type(body).__name__
                )
            self._body = body.encode()
        return self._body

    def body_size(self, limit: int) -> int:
        """The frame body's size, at most `limit`."""
        n = len(self.body())
        if n > limit:
            raise BodyTooLargeError(f"body: expected at most {limit} bytes, got {n}")
        return n

    def most(self, limit: int) -> int:
        """`limit`: the frame is in already, its size known."""
        return limit

    def kept(self, nbytes: int) -> int:
        return nbytes

    def arrived(self) -> bytes:
        """The frame's body: in already."""
        return self.body()

    async def receive(self) -> MutableMapping[str, Any]:
        """The frame's body as the one ASGI message of a body (`arrived()` holds it already)."""
        return {"type": "http.request", "body": self.body(), "more_body": False}

    async def read(self) -> bytes:
        return self.body()

    def gone(self) -> Awaitable[None]:
        return self._gone

    def timeout(self) -> float | None:
        """The frame's `timeout` field, seconds (InvalidInputError where it is no number)."""
        raw = self.message.get("timeout")
        return None if raw is None else deadline.timeout_of(raw, "timeout")


def trusted_proxies(allowed: str | None) -> _TrustedHosts | None:
    """The proxies whose `x-forwarded-for` names a gRPC call's client (`forwarded_allow_ips`,
    parsed once, as uvicorn parses it for HTTP); None: no forwarded address is trusted."""
    return None if allowed is None else _TrustedHosts(allowed)


def peer_address(peer: str) -> tuple[str, int] | None:
    """The address and port in a gRPC peer string (`ipv4:10.0.0.1:5000`, `ipv6:[::1]:5000`, or
    `ipv6:%5B::1%5D:5000` as newer grpc writes it); None for a peer with none (`unix:...`)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = unquote(rest).rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return None
    return host, int(port)


def peer_host(peer: str) -> str | None:
    """The address in a gRPC peer string (`peer_address`); None for a peer with none."""
    address = peer_address(peer)
    return None if address is None else address[0]


class GrpcDoor:
    """A gRPC call: its caller is the tenant its `authorization` metadata's bearer token names,
    else the peer's address (a proxy's `x-forwarded-for` only where the operator trusts that
    proxy, as on HTTP); its bytes are its one request message, read whole by grpc's transport
    (which refuses one above `limit`, the message limit of every method, before it is read: the
    pipeline holds that much for the call before it asks for the message), and `gone` the
    call's end before the answer (a cancel, the caller's own deadline, a lost connection)."""

    whole = True

    def __init__(self, context: Any, proxies: _TrustedHosts | None, limit: int) -> None:
        self.context = context
        self.limit = limit  # the transport's message limit, one for every method
        self.metadata = {k.lower(): v for k, v in context.invocation_metadata() or ()}
        self.peer: str = context.peer()  # its connection: the caller's address and port
        host = peer_host(self.peer)
        forwarded = self.metadata.get("x-forwarded-for")
        if proxies is not None and isinstance(forwarded, str) and host in proxies:
            host = proxies.get_trusted_client_address(forwarded)[0] or host
        self.caller = Caller.of(host)
        self._size = 0  # the message's bytes: the pipeline holds the message, the door never
        loop = asyncio.get_running_loop()
        self._gone: asyncio.Future[None] = loop.create_future()

        def done(_: object) -> None:
            loop.call_soon_threadsafe(_settle, self._gone)

        context.add_done_callback(done)

    def authorize(self, tenants: Tenants) -> None:
        """The bearer token in the `authorization` metadata, as `HttpDoor.authorize`."""
        if not tenants.required:
            return
        value = self.metadata.get("authorization")
        tenant = tenants.caller(bearer(value if isinstance(value, str) else None))
        if tenant is not None:
            self.caller = tenant

    def identify(self, tenants: Tenants) -> None:
        """`caller` the tenant a good token names, else left the peer's: who a call is charged
        to before it is known whether its method needs a token."""
        with contextlib.suppress(UnauthorizedError):
            self.authorize(tenants)

    async def read(self) -> bytes:
        """The request message, read whole (ClientDisconnect where the call ended instead: the
        caller cancelled, or grpc refused a message above its limit and ended the call;
        WireFormatError where the caller closed its side without one)."""
        raw = await self.context.read()
        if self.context.done() or self.context.cancelled():
            raise ClientDisconnect
        if not isinstance(raw, bytes):  # the caller closed its side without a message
            raise WireFormatError("message", "one request message", "none")
        self._size = len(raw)
        return raw

    @property
    def size(self) -> int:
        """The message's bytes, once read (0 before)."""
        return self._size

    def body_size(self, limit: int) -> int:
        """The message's size, at most `limit`."""
        n = self._size
        if n > limit:
            raise BodyTooLargeError(f"message: expected at most {limit} bytes, got {n}")
        return n

    def most(self, limit: int) -> int:
        """`COPIES` times the transport's message limit where it is above `limit`: grpc reads a
        message whole, up to one limit for every method, before the service sees its size."""
        return COPIES * max(limit, self.limit)

    def kept(self, nbytes: int) -> int:
        """Twice the message: it and its copy into the workers' buffer, while it is decoded."""
        return 2 * nbytes

    def arrived(self) -> None:
        """None: the message is still to come, by `read`."""
        return None

    async def receive(self) -> MutableMapping[str, Any]:
        raise NotImplementedError("a gRPC message comes whole, by read")

    def gone(self) -> Awaitable[None]:
        return self._gone

    def hang_up(self) -> None:
        """The caller went (grpc cancelled its handler): `gone` completes."""
        _settle(self._gone)

    def timeout(self) -> float | None:
        """What is left of the call's gRPC deadline, where its caller set one."""
        left = self.context.time_remaining()
        return None if left is None else max(float(left), 1e-3)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
