"""The Unix socket that same-host clients hand their regions over (protocol: `_region_wire`).

It runs on the event loop, reading through `add_reader` without blocking, so it shares the
`RegionRegistry` with the HTTP handlers without a lock. Closing a connection ends its regions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._errors import InvalidInputError, UnauthorizedError, ZenMLAError, status_of
from ._region_wire import FrameReader, encode_frame
from .regions import Region, RegionRegistry

__all__ = ["RegionServer"]

log = logging.getLogger("zen_mla.regions")
_MAX_FDS = 4  # descriptors read per message; more are closed unread


@dataclass
class _Client:
    id: int
    sock: socket.socket
    reader: FrameReader = field(default_factory=FrameReader)
    fds: list[int] = field(default_factory=list)
    greeted: bool = False
    regions: dict[str, Region] = field(default_factory=dict)


class RegionServer:
    """Listens on `path`; `token`, when set, must open every connection (`hello`), whose answer
    names `instance`, as `/health` does."""

    def __init__(
        self,
        path: str,
        registry: RegionRegistry,
        *,
        token: str | None,
        max_clients: int,
        instance: str,
    ) -> None:
        self.path, self.registry, self.token, self.max_clients = path, registry, token, max_clients
        self.instance = instance  # /health names it too: a client checks it reached this server
        self._listener: socket.socket | None = None
        self._clients: dict[int, _Client] = {}
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Listen on `path`: its folder is made owner-only when created here, the socket is
        owner-only, and a stale socket file left by a killed server is replaced."""
        folder = Path(self.path).parent
        if not folder.exists():
            folder.mkdir(mode=0o700, parents=True)
        info = folder.stat()
        open_to_others = info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX
        if info.st_uid not in (0, os.getuid()) or open_to_others:
            raise PermissionError(
                f"{folder}: expected a folder of this user's (or root's) that others cannot "
                f"write to, for the regions' socket; got owner {info.st_uid}, mode "
                f"{stat.S_IMODE(info.st_mode):o}"
            )
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # the socket is created 0600, never briefly wider
            try:
                listener.bind(self.path)
            finally:
                os.umask(old)
            listener.listen(64)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(listener.fileno(), self._accept)

    def close(self) -> None:
        if self._listener is None or self._loop is None:
            return
        self._loop.remove_reader(self._listener.fileno())
        self._listener.close()
        self._listener = None
        for client in list(self._clients.values()):
            self._drop(client)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @property
    def clients(self) -> int:
        return len(self._clients)

    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors: the client retries; we stay up
            log.warning("region socket: accept failed: %s", exc)
            return
        if len(self._clients) >= self.max_clients:
            with contextlib.suppress(OSError):
                sock.send(encode_frame(_refusal(503, "too many region clients")))
            sock.close()
            return
        sock.setblocking(False)
        client = _Client(next(self._ids), sock, greeted=self.token is None)
        self._clients[client.id] = client
        self._loop.add_reader(sock.fileno(), self._readable, client)

    def _readable(self, client: _Client) -> None:
        try:
            data, ancdata, flags, _ = client.sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * _MAX_FDS))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(client)
            return
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                client.fds.extend(
                    int.from_bytes(payload[i : i + 4], "little") for i in range(0, usable, 4)
                )
        if not data or flags & socket.MSG_CTRUNC:
            self._drop(client)
            return
        client.reader.feed(data)
        try:
            while (message := client.reader.next()) is not None:
                reply = self._handle(client, message)
                client.sock.send(encode_frame(reply))  # small: fits the socket buffer
                if not reply["ok"] and reply["status"] == 401:
                    self._drop(client)
                    return
        except (ValueError, OSError) as exc:
            log.info("region socket: client %d dropped: %s", client.id, exc)
            self._drop(client)

    def _handle(self, client: _Client, message: dict[str, Any]) -> dict[str, Any]:
        fds, client.fds = client.fds, []
        try:
            op = message.get("op")
            if op == "hello":
                return self._hello(client, message)
            if not client.greeted:
                raise UnauthorizedError("say hello with the bearer token first")
            if op == "register":
                if len(fds) != 1:
                    raise InvalidInputError("register", "exactly one descriptor", f"{len(fds)}")
                region = self.registry.register(fds.pop(), client.regions)
                return {"ok": True, "region": region.handle, "nbytes": region.nbytes}
            if op == "unregister":
                self.registry.unregister(str(message.get("region", "")), client.regions)
                return {"ok": True}
            raise InvalidInputError("op", "hello, register or unregister", repr(op)[:40])
        except ZenMLAError as exc:
            return _refusal(status_of(exc), str(exc))
        finally:
            for fd in fds:
                os.close(fd)

    def _hello(self, client: _Client, message: dict[str, Any]) -> dict[str, Any]:
        if self.token is not None:
            given = str(message.get("token", "")).encode()
            if not hmac.compare_digest(given, self.token.encode()):
                raise UnauthorizedError("a valid bearer token is required")
        client.greeted = True
        return {
            "ok": True,
            "max_regions": self.registry.max_regions,
            "max_bytes": self.registry.max_bytes,
            "instance": self.instance,
        }

    def _drop(self, client: _Client) -> None:
        if self._clients.pop(client.id, None) is None:
            return
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(client.sock.fileno())
        for fd in client.fds:
            os.close(fd)
        client.fds.clear()
        self.registry.drop(client.regions)
        client.sock.close()


def _refusal(status: int, error: str) -> dict[str, Any]:
    return {"ok": False, "status": status, "error": error}
