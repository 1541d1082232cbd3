"""How a request came in, as the pipeline (`pipeline`) needs to know it (`Door`): who sent it
(the client admission counts), whether its token is good, how many bytes it brings and whether
they are in already, and when its sender hangs up. Two doors: an HTTP request (`HttpDoor`), whose
body is still to come, and a prefill frame on the region socket (`CallDoor`), whose bytes the
socket's one frame reader read already."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Hashable, MutableMapping
from typing import Any, Protocol

from fastapi import Request

from zen_mla import BodyTooLargeError, InvalidInputError, LengthRequiredError

from .admission import client_of
from .body import Receive
from .tenants import Tenants

__all__ = ["CallDoor", "Door", "HttpDoor", "byte_count"]


class Door(Protocol):
    """A way in, as the pipeline uses it whichever it is.

    `client`: who is charged (admission's client; `authorize` may name a tenant instead).
    `body_size(limit)`: the bytes the request brings, refused above `limit` before any is read.
    `arrived()`: those bytes where the door holds them already, read by a reader of its own
    (charged as they are: no upload slot, no rate); None where they are still to come, by
    `receive` (ASGI messages, read by the pipeline's one body reader). `gone()`: completes once
    the sender hangs up."""

    client: Hashable

    def authorize(self, tenants: Tenants) -> None:
        """The request's token checked, where one is required (UnauthorizedError otherwise);
        `client` is then the tenant it names."""

    def body_size(self, limit: int) -> int:
        """The bytes the request brings, at most `limit` (BodyTooLargeError above it)."""

    def arrived(self) -> bytes | None:
        """The bytes, where they are in already; None: to be read from `receive`."""

    def receive(self) -> Awaitable[MutableMapping[str, Any]]:
        """The body's next ASGI message."""

    def gone(self) -> Awaitable[None]:
        """Completes once the sender hangs up."""


def byte_count(raw: str) -> int | None:
    """A header's byte count: ASCII digits only (str.isdigit() takes "²" and int() 5,000
    digits, both costly or fatal later), at most 18 of them; None otherwise."""
    raw = raw.strip()
    if not (0 < len(raw) <= 18 and raw.isascii() and raw.isdigit()):
        return None
    return int(raw)


class HttpDoor:
    """An HTTP request: its client is the tenant its bearer token names, else the peer's address
    (a proxy's X-Forwarded-For only where the operator trusts that proxy: see `tenants`), its
    bytes the body its Content-Length announces."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.client: Hashable = client_of(request.client.host if request.client else None)
        self.receive: Receive = request.receive

    def authorize(self, tenants: Tenants) -> None:
        """The bearer token, where one is required (UnauthorizedError otherwise); the client is
        the tenant it names, where tenants have tokens."""
        if not tenants.required:
            return
        scheme, _, token = self.request.headers.get("authorization", "").partition(" ")
        tenant = tenants.client(token if scheme.lower() == "bearer" else None)
        if tenant is not None:
            self.client = tenant

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

    def arrived(self) -> None:
        """None: the body is still to come, by `receive`."""
        return None

    async def gone(self) -> None:
        """Returns once the client hangs up."""
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                return


class CallDoor:
    """A prefill frame on the region socket: its client is the tenant the socket's hello token
    named, else the peer's uid (SO_PEERCRED); its token was checked by that hello, its bytes are
    the frame's `body`, and the socket's end is `gone`."""

    def __init__(
        self,
        message: dict[str, Any],
        gone: asyncio.Future[None],
        uid: int | None,
        tenant: Hashable = None,
    ) -> None:
        self.message = message
        self.client: Hashable = tenant if tenant is not None else client_of(uid)
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

    def arrived(self) -> bytes:
        """The frame's body: in already."""
        return self.body()

    async def receive(self) -> MutableMapping[str, Any]:
        """The frame's body as the one ASGI message of a body (`arrived()` holds it already)."""
        return {"type": "http.request", "body": self.body(), "more_body": False}

    def gone(self) -> Awaitable[None]:
        return self._gone
