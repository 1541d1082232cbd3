"""The Unix socket that same-host clients hand their regions over (protocol: `protocol`).

It runs on the event loop, reading through `add_reader` without blocking, so it shares the
`RegionRegistry` with the HTTP handlers without a lock. Closing a connection ends its regions
(unmapped once no request in flight names them). One user's connections (SO_PEERCRED) share one
byte budget of regions; their calls count as the client the hello's token names, else the uid.

The door's rules hold here as on HTTP: a connection must say `hello` (with the token, where one
is set) within `hello_timeout_s`, and holds no descriptor and at most one frame until then;
connections still to say hello are capped apart (`max_unauthenticated`, the oldest evicted
first), so only authenticated ones count toward `max_clients`. Every frame is capped at
`MAX_MESSAGE` bytes and, once its first byte came, must be whole within `frame_timeout_s`; a
connection holds at most one pending descriptor, and only a `register` frame may carry it. An
idle authenticated connection stays open: it is the lifetime of its client's regions.

Where the service passes a `calls` hook, a connection that said hello may also send a `prefill`
frame (a call, with no HTTP on its way): the hook answers it, or has a worker write the reply
to the connection's descriptor itself. So it answers `weight` and `forget` frames (a weight
registered from a region, or forgotten). While a call runs, the connection is not read (a second
frame waits in the socket until the call is over); it is only watched for its end (a peek),
which the hook sees as `gone` resolving.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..caller import Caller
from ..errors import (
    InvalidInputError,
    ServiceUnavailableError,
    UnauthorizedError,
    ZenMLAError,
    status_of,
)
from .protocol import FrameError, FrameReader, descriptors, encode_frame, listen, peer_uid
from .registry import Region, RegionRegistry

__all__ = ["CALL_OPS", "Authorize", "Calls", "Ended", "RegionServer"]

#: the frames a `calls` hook answers: a prefill, and a weight registered from a region or
#: forgotten (`docs/protocol.md`, "Calls on the region socket")
CALL_OPS = ("prefill", "weight", "forget")

#: the service's answer to a frame of `CALL_OPS`: (the frame, a future that resolves when the client
#: hangs up, the connection's descriptor, the peer's uid, whom its hello's token named, the
#: connection's number) -> the reply, or None where a worker wrote it to the descriptor itself
#: (whole, or the connection shut down)
Calls = Callable[
    [dict[str, Any], "asyncio.Future[None]", int, int | None, Caller | None, int],
    Awaitable[dict[str, Any] | None],
]
#: told a connection's number once it has ended (what the service kept for it goes with it)
Ended = Callable[[int], None]
#: checks a hello's token (None: none given): returns whom it names (None: no one, the peer's
#: uid counts), raises UnauthorizedError for one that opens nothing
Authorize = Callable[[str | None], Caller | None]

log = logging.getLogger("zen_mla.regions")
# Room for one descriptor; CMSG_SPACE rounds up to 8 bytes, so two fit and more are cut off
# (MSG_CTRUNC; the kernel closes what did not fit): either way, the connection ends.
_CMSG_SPACE = socket.CMSG_SPACE(4)
_ACCEPT_PAUSE_S = 0.1  # out of descriptors: wait before accepting again, not spin on it


@dataclass(eq=False)
class _Client:
    id: int
    sock: socket.socket
    uid: int | None  # the peer's (SO_PEERCRED): whose byte budget its regions count against
    named: Caller | None = None  # whom its hello's token names, where tokens name tenants
    reader: FrameReader = field(default_factory=FrameReader)
    fd: int | None = None  # the descriptor of the frame being read (register's memfd)
    greeted: bool = False
    regions: dict[str, Region] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None  # the hello deadline, then each frame's
    gone: asyncio.Future[None] | None = None  # while a call runs: resolves when the client ends
    paused: bool = False  # not watched for reading: a next frame came while a call ran


class RegionServer:
    """Listens on `path`; `authorize`, when set, checks the token that must open every
    connection (`hello`, whose answer names `instance`, as `/health` does) and says whom it
    names, which its calls are told.

    `max_clients` caps connections that said hello; `max_unauthenticated` those yet to, the
    oldest evicted when one more comes; `hello_timeout_s` is how long a connection has to say
    hello, `frame_timeout_s` how long a frame may take once its first byte came. `calls`, when
    given, answers the frames of `CALL_OPS` (and hello says `"calls": true`); `ended` is told
    each connection that said hello once it has ended."""

    def __init__(
        self,
        path: str,
        registry: RegionRegistry,
        *,
        authorize: Authorize | None,
        max_clients: int,
        instance: str,
        hello_timeout_s: float = 5.0,
        frame_timeout_s: float = 5.0,
        max_unauthenticated: int = 16,
        calls: Calls | None = None,
        ended: Ended | None = None,
    ) -> None:
        self.path, self.registry, self.authorize = path, registry, authorize
        self.max_clients = max_clients
        self.instance = instance  # /health names it too: a client checks it reached this server
        self.hello_timeout_s, self.frame_timeout_s = hello_timeout_s, frame_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self._calls = calls
        self._ended = ended
        # calls in flight, one per connection at most
        self._running: set[asyncio.Task[None]] = set()
        self._listener: socket.socket | None = None
        self._clients: dict[int, _Client] = {}  # said hello
        self._waiting: dict[int, _Client] = {}  # yet to, oldest first
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Listen on `path`: its folder is made owner-only when created here, the socket is
        owner-only, and a stale socket file left by a killed server is replaced."""
        listener = listen(self.path)
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(listener.fileno(), self._accept)

    def close(self) -> None:
        if self._listener is None or self._loop is None:
            return
        self._loop.remove_reader(self._listener.fileno())
        self._listener.close()
        self._listener = None
        for client in [*self._waiting.values(), *self._clients.values()]:
            self._drop(client)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @property
    def clients(self) -> int:
        """Connections that said hello."""
        return len(self._clients)

    @property
    def waiting(self) -> int:
        """Connections yet to say hello."""
        return len(self._waiting)

    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("region socket: accept failed: %s", exc)
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # the listener stays readable: pause rather than call back at once, forever
                self._loop.remove_reader(self._listener.fileno())
                self._loop.call_later(_ACCEPT_PAUSE_S, self._resume_accepting)
            return
        sock.setblocking(False)
        if len(self._waiting) >= self.max_unauthenticated:
            oldest = next(iter(self._waiting.values()))
            self._refuse(oldest, 503, "too many region connections yet to say hello")
        client = _Client(next(self._ids), sock, peer_uid(sock.fileno()))
        self._waiting[client.id] = client
        client.timer = self._loop.call_later(
            self.hello_timeout_s, self._expire, client, f"no hello within {self.hello_timeout_s} s"
        )
        self._loop.add_reader(sock.fileno(), self._readable, client)

    def _resume_accepting(self) -> None:
        if self._listener is not None and self._loop is not None:
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def _readable(self, client: _Client) -> None:
        """Reads of a frame's bytes (and its descriptor) while they are there, never past its
        end: a frame sent whole costs one turn of the loop. While a call runs, only a look for
        the connection's end (`_watch`)."""
        if client.gone is not None:
            self._watch(client)
            return
        message = None
        while message is None:
            try:
                data, ancdata, flags, _ = client.sock.recvmsg(client.reader.wanted(), _CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(client)
                return
            if not self._took(client, data, ancdata, flags):
                return
            try:
                message = client.reader.feed(data)
            except FrameError as exc:
                self._refuse(client, exc.status, str(exc))
                return
        if client.greeted:
            self._stop_timer(client)
            if message.get("op") in CALL_OPS and self._calls is not None and client.fd is None:
                self._call(client, message, self._calls)
                return
        try:
            reply = self._handle(client, message)
        except Exception:  # a bug here must cost this connection only, never the loop's reader
            log.exception("region socket: client %d", client.id)
            self._refuse(client, 500, "the region socket failed on this message")
            return
        if not reply["ok"] and not client.greeted:  # no hello, a bad token, or no room
            self._refuse(client, reply["status"], reply["error"])
        else:
            self._send(client, reply)

    def _took(
        self, client: _Client, data: bytes, ancdata: list[tuple[int, int, bytes]], flags: int
    ) -> bool:
        """One read's descriptor, end and frame timer; False when the connection ended."""
        fds = descriptors(ancdata)  # at most two fit in _CMSG_SPACE
        if fds:
            many = len(fds) > 1 or client.fd is not None
            if client.fd is None:
                client.fd = fds.pop(0)  # the connection's from here: _drop closes it
            for fd in fds:
                os.close(fd)
            if not client.greeted or many or flags & socket.MSG_CTRUNC:
                self._refuse(client, 400, "a descriptor before hello, or more than one a frame")
                return False
        if flags & socket.MSG_CTRUNC:
            self._refuse(client, 400, "more than one descriptor a frame")
            return False
        if not data:
            self._drop(client)
            return False
        if client.greeted and client.timer is None and self._loop is not None:  # first byte
            why = f"a frame not whole within {self.frame_timeout_s} s"
            client.timer = self._loop.call_later(self.frame_timeout_s, self._expire, client, why)
        return True

    def _handle(self, client: _Client, message: dict[str, Any]) -> dict[str, Any]:
        fd, client.fd = client.fd, None
        try:
            op = message.get("op")
            if fd is not None and op != "register":
                raise InvalidInputError(
                    "descriptor", "one only with register", f"one with {op!r:.40}"
                )
            if op == "hello":
                return self._hello(client, message)
            if not client.greeted:
                raise UnauthorizedError("say hello (with the bearer token, where one is set) first")
            if op == "register":
                if fd is None:
                    raise InvalidInputError("register", "one descriptor with it", "none")
                taken, fd = fd, None
                region = self.registry.register(taken, client.regions, client.uid)  # closes it
                return {"ok": True, "region": region.handle, "nbytes": region.nbytes}
            if op == "unregister":
                self.registry.unregister(str(message.get("region", "")), client.regions)
                return {"ok": True}
            ops = "hello, register, unregister" + (
                ", " + ", ".join(CALL_OPS) if self._calls else ""
            )
            raise InvalidInputError("op", ops, f"{op!r:.40}")
        except ZenMLAError as exc:
            return _refusal(status_of(exc), str(exc))
        finally:
            if fd is not None:
                os.close(fd)

    def _hello(self, client: _Client, message: dict[str, Any]) -> dict[str, Any]:
        if self.authorize is not None:
            token = message.get("token")
            client.named = self.authorize(None if token is None else str(token))
        if not client.greeted:
            if len(self._clients) >= self.max_clients:
                raise ServiceUnavailableError("too many region clients")
            del self._waiting[client.id]
            self._clients[client.id] = client
            client.greeted = True
            self._stop_timer(client)
        return {
            "ok": True,
            "max_regions": self.registry.max_regions,
            "max_bytes": self.registry.max_bytes,
            "instance": self.instance,
            "calls": self._calls is not None,
        }

    def _call(self, client: _Client, message: dict[str, Any], calls: Calls) -> None:
        """Run a call: until its reply is sent, `_readable` only watches for the end."""
        assert self._loop is not None
        client.gone = self._loop.create_future()
        task = self._loop.create_task(self._answer(client, message, calls, client.gone))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _answer(
        self,
        client: _Client,
        message: dict[str, Any],
        calls: Calls,
        gone: asyncio.Future[None],
    ) -> None:
        try:
            fd = client.sock.fileno()
            reply = await calls(message, gone, fd, client.uid, client.named, client.id)
        except Exception:  # the hook answers its errors; a bug costs this connection only
            log.exception("region socket: client %d's call", client.id)
            reply = _refusal(500, "the region socket failed on this call")
        if client.id not in self._clients or client.gone is not gone:
            return  # gone meanwhile: nobody to answer
        client.gone = None
        if not gone.done():
            gone.cancel()
        if client.paused:
            assert self._loop is not None
            client.paused = False
            self._loop.add_reader(client.sock.fileno(), self._readable, client)
        if reply is not None:
            self._send(client, reply)

    def _watch(self, client: _Client) -> None:
        """While a call runs: whether the client ended (a peek, nothing read). A next frame
        already sent stays unread, and the watch stops until the reply is sent."""
        try:
            ended = not client.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            ended = True
        if ended:
            self._drop(client)
        elif self._loop is not None:
            self._loop.remove_reader(client.sock.fileno())
            client.paused = True

    def _expire(self, client: _Client, why: str) -> None:
        client.timer = None
        self._refuse(client, 408, why)

    def _stop_timer(self, client: _Client) -> None:
        if client.timer is not None:
            client.timer.cancel()
            client.timer = None

    def _send(self, client: _Client, reply: dict[str, Any]) -> None:
        """A reply fits an empty socket buffer; one that does not fit is a client that does not
        read its replies, and ends its connection."""
        data = encode_frame(reply)
        with contextlib.suppress(OSError):
            if client.sock.send(data) == len(data):
                return
        self._drop(client)

    def _refuse(self, client: _Client, status: int, error: str) -> None:
        """The refusal, where the socket takes it at once, then the connection closed."""
        log.debug("region socket: client %d refused (%d): %s", client.id, status, error)
        with contextlib.suppress(OSError):
            client.sock.send(encode_frame(_refusal(status, error)))
        self._drop(client)

    def _drop(self, client: _Client) -> None:
        if (self._clients.pop(client.id, None) or self._waiting.pop(client.id, None)) is None:
            return
        self._stop_timer(client)
        if client.gone is not None and not client.gone.done():
            client.gone.set_result(None)  # the call's work is abandoned as a hung-up HTTP one's
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(client.sock.fileno())
        if client.fd is not None:
            os.close(client.fd)
            client.fd = None
        self.registry.drop(client.regions)
        if self._ended is not None and client.greeted:
            self._ended(client.id)
        with contextlib.suppress(OSError):  # ended, should a worker still hold it (a reply)
            client.sock.shutdown(socket.SHUT_RDWR)
        client.sock.close()


def _refusal(status: int, error: str) -> dict[str, Any]:
    return {"ok": False, "status": status, "error": error}
