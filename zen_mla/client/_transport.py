"""The clients' transports: httpx's, with sockets that mark each send's bytes as they go and come
(`_resend.heard`: a request is sent again only where no byte of an answer came), and connects
that wait at most their share of what the call has left (`Deadline.connect_timeout`). The
blocking client's sockets also wait at most what the calling thread's call has left, and a large
answer's body is read from its socket straight into place."""

from __future__ import annotations

import contextlib
import contextvars
import socket
import ssl
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx

from ._answers import Body
from ._deadline import Deadline
from ._resend import heard

__all__ = ["DIRECT_MIN", "DeadlineTransport", "HeardTransport", "call_deadline", "read_body"]

# An answer this large is read from the socket straight into its buffer; a smaller one through
# httpx. Reading past httpx leaves its connection unusable for another request (it is closed:
# a new one costs a connect, ~0.1 ms on loopback, against 20+ ms for such an answer).
DIRECT_MIN = 1 << 20
_READ_PART = 4 << 20  # bytes asked of one recv_into
_FIN_WAIT = 0.05  # seconds, at most, for the service's end of a connection it said it closes

# The calling thread's (or task's) call, set for the call's length (`call_deadline`): its
# connects wait at most their share of what the call has left; PrefillClient's reads and writes
# at most what it has left.
_CALL_DEADLINE: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "zen_mla_call_deadline", default=None
)


@contextlib.contextmanager
def call_deadline(deadline: Deadline) -> Iterator[None]:
    """Within the block, the calling thread's (or asyncio task's) sockets wait as `deadline`
    says."""
    token = _CALL_DEADLINE.set(deadline)
    try:
        yield
    finally:
        _CALL_DEADLINE.reset(token)


def _op_timeout(timeout: float | None, late: type[Exception]) -> float | None:
    """A socket operation's timeout, cut to what the calling thread's call has left."""
    deadline = _CALL_DEADLINE.get()
    left = None if deadline is None else deadline.remaining()
    if left is None:
        return timeout
    if left <= 0:
        raise late("the call's timeout has passed")
    return left if timeout is None else min(timeout, left)


def _connect_timeout(timeout: float | None) -> float | None:
    """A connect's timeout (TCP's, TLS's handshake), cut to its share of what the calling
    thread's (or task's) call has left (`Deadline.connect_timeout`)."""
    deadline = _CALL_DEADLINE.get()
    bound = timeout if deadline is None else deadline.connect_timeout(timeout)
    if bound is not None and bound <= 0:
        raise httpcore.ConnectTimeout("the call's timeout has passed")
    return bound


def _pool_options(ssl_context: Any, uds: str | None) -> dict[str, Any]:
    """The options httpx makes its connection pool with (by default). httpx takes no network
    backend: the transports make their pool again, as httpx makes it, with one of their own."""
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
    return {
        "ssl_context": ssl_context,
        "max_connections": limits.max_connections,
        "max_keepalive_connections": limits.max_keepalive_connections,
        "keepalive_expiry": limits.keepalive_expiry,
        "uds": uds,
    }


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = self._stream.read(max_bytes, _op_timeout(timeout, httpcore.ReadTimeout))
        heard(came=data)
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        heard(sent=buffer)  # before: a write that fails may have sent a part
        self._stream.write(buffer, _op_timeout(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def plain_socket(self) -> socket.socket | None:
        """The socket under this stream where reading it gives the answer's bytes (not over
        TLS, nor through a proxy's tunnel), else None."""
        sock = self._stream.get_extra_info("socket")
        if type(sock) is not socket.socket or self._stream.get_extra_info("ssl_object"):
            return None
        return sock

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        timeout = _connect_timeout(timeout)
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _connect_timeout(timeout)
        return _DeadlineStream(
            self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        timeout = _connect_timeout(timeout)
        return _DeadlineStream(self._backend.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class DeadlineTransport(httpx.HTTPTransport):
    """httpx's transport whose sockets wait at most what the calling thread's call has left.

    httpx bounds each read, and an answer trickled a byte at a time (headers too, which httpcore
    reads in its own loop) never trips that; the asyncio client cancels its call instead."""

    def __init__(self, uds: str | None, ssl_context: ssl.SSLContext | None = None) -> None:
        ssl_context = ssl_context or httpx.create_ssl_context()  # one a client's endpoints share
        super().__init__(verify=ssl_context, uds=uds)
        self._pool = httpcore.ConnectionPool(
            **_pool_options(ssl_context, uds), network_backend=_DeadlineBackend()
        )


class _HeardStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = await self._stream.read(max_bytes, timeout)
        heard(came=data)
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        heard(sent=buffer)  # before: a write that fails may have sent a part
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        timeout = _connect_timeout(timeout)
        return _HeardStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _HeardBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        timeout = _connect_timeout(timeout)
        return _HeardStream(
            await self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        )

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        timeout = _connect_timeout(timeout)
        return _HeardStream(await self._backend.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class HeardTransport(httpx.AsyncHTTPTransport):
    """The asyncio client's transport: httpx's, whose sockets mark each send's bytes and whose
    connects take their share of the task's call (the asyncio client bounds its calls by
    cancelling them, not by its sockets' reads)."""

    def __init__(self, uds: str | None, ssl_context: ssl.SSLContext | None = None) -> None:
        ssl_context = ssl_context or httpx.create_ssl_context()  # one a client's endpoints share
        super().__init__(verify=ssl_context, uds=uds)
        self._pool = httpcore.AsyncConnectionPool(
            **_pool_options(ssl_context, uds), network_backend=_HeardBackend()
        )


def read_body(answer: httpx.Response, body: Body, timeout: float | None) -> None:
    """The answer's body into `body`, until it has all it wants. What httpx holds already comes
    through httpx; the rest of an answer of `DIRECT_MIN` bytes or more is read from the socket
    straight into `body`'s buffer (no joins, no copies: h11 would copy each byte twice more) when
    the socket is one of `DeadlineTransport`'s, plain, and the answer framed by its length alone;
    each read waits at most `timeout`, cut to what the call has left."""
    stream = answer.extensions.get("network_stream")
    sock = stream.plain_socket() if isinstance(stream, _DeadlineStream) else None
    # framed by its Content-Length alone: with a Transfer-Encoding too, h11 reads it chunked
    # (as HTTP says), and the raw socket would give the chunks' framing as the answer's bytes
    framed = "transfer-encoding" not in answer.headers
    direct = sock is not None and framed and body.left >= DIRECT_MIN
    # held until the body is read: dropping the generator closes httpx's connection
    chunks = answer.iter_raw()
    for chunk in chunks:
        if not body.take(chunk):
            return
        if direct:
            break  # h11 gave what it had read past the headers: the rest is on the socket
    else:
        return
    assert sock is not None
    try:
        while body.left:
            into = body.rest(_READ_PART)
            sock.settimeout(_op_timeout(timeout, httpx.ReadTimeout))
            n = sock.recv_into(into)
            if n == 0:
                return  # the service hung up early: `whole()` says so
            body.advance(n)
    except TimeoutError as exc:  # socket.timeout
        raise httpx.ReadTimeout(f"reading the answer: {exc}") from exc
    except OSError as exc:
        raise httpx.ReadError(f"reading the answer: {exc}") from exc
    if answer.headers.get("connection", "").lower() == "close":
        # the service closes first (it said so): its end comes right after the answer, and
        # waiting for it (within the call's time: none left is a TimeoutError, an OSError)
        # leaves the TIME_WAIT to the service rather than to a port of this host
        with contextlib.suppress(OSError):
            sock.settimeout(_op_timeout(_FIN_WAIT, TimeoutError))
            sock.recv(1)
