"""The same-host region socket's messages: a 4-byte big-endian length, then a JSON object of a
few flat fields; a `register` message carries one descriptor (SCM_RIGHTS) in the same `sendmsg`.

    client                                   service
    {"op": "hello", "token": "..."}    ->    {"ok": true, "max_regions": 64, "max_bytes": ...}
    {"op": "register"} + memfd         ->    {"ok": true, "region": "<handle>", "nbytes": N}
    {"op": "unregister", "region": h}  ->    {"ok": true}
    {"op": "prefill", "call": n, ...}  ->    {"ok": true, "call": n, ...} (service/routes/calls.py)
    anything wrong                     ->    {"ok": false, "status": 4xx, "error": "..."}

`listen` makes the service's socket. `hello` comes first, also without a token. One request at
a time per connection; the reply comes before the next request is read. Closing the connection
ends every region registered over it. A call's reply carries its number: a worker may write it
while the service answers the same call past its deadline, and the client passes over a reply
to an earlier call.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..deadline import seconds_text

__all__ = [
    "CALL_ROOM",
    "MAX_FIELDS",
    "MAX_MESSAGE",
    "FrameError",
    "FrameReader",
    "call_fields",
    "decode_message",
    "decode_object",
    "descriptors",
    "encode_frame",
    "listen",
    "numbered",
    "peer_uid",
    "recv_frame",
    "send_frame",
]

MAX_MESSAGE = 64 << 10
MAX_FIELDS = 16
_LEN = struct.Struct(">I")
_CALL = b'{"op":"prefill","call":'
#: what a call's frame holds beside its fields: its length, its head, its number and timeout
CALL_ROOM = _LEN.size + len(_CALL) + 20 + 32
_FLAT = f"a JSON object of at most {MAX_FIELDS} fields, each a string, number, bool or null"


class FrameError(ValueError):
    """A frame that breaks the protocol; `status` is the refusal's (the connection then ends)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def encode_frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _LEN.pack(len(data)) + data


def call_fields(fields: dict[str, Any]) -> bytes:
    """A `prefill` frame's JSON but its op and number (`numbered` completes it): what a client
    keeps and sends again, layer after layer."""
    return b"," + json.dumps(fields, separators=(",", ":")).encode()[1:]


def numbered(call: int, fields: bytes, timeout: float | None = None) -> bytes:
    """The frame of call number `call` with `fields` (`call_fields`'s), and the caller's
    `timeout` (the seconds it has left, where it has a deadline)."""
    head = b"%s%d" % (_CALL, call)
    if timeout is not None:
        head += b',"timeout":%s' % seconds_text(timeout).encode()
    data = head + fields
    return _LEN.pack(len(data)) + data


class FrameReader:
    """Bytes in, whole messages out, one frame at a time: `wanted()` is how many bytes to read
    next, never past the frame being read, so a reader holds at most one frame (and a read never
    takes the next frame's descriptor). `decode` makes a whole frame's bytes a message: a
    request's rules (`decode_message`, the service's) or any JSON object (`decode_object`, the
    client's, for replies)."""

    def __init__(self, decode: Callable[[bytes], dict[str, Any]] | None = None) -> None:
        self._decode = decode_message if decode is None else decode
        self._head = bytearray()
        self._body = bytearray()
        self._size: int | None = None  # the frame's length, once its 4 bytes came

    @property
    def started(self) -> bool:
        """Some bytes of a frame came, not all of it."""
        return bool(self._head)

    def wanted(self) -> int:
        if self._size is None:
            return _LEN.size - len(self._head)
        return self._size - len(self._body)

    def feed(self, data: bytes) -> dict[str, Any] | None:
        """Take `data` (at most `wanted()` bytes); the message once its frame is whole, else
        None. FrameError for an oversized or malformed one."""
        if self._size is None:
            self._head += data
            if len(self._head) < _LEN.size:
                return None
            (n,) = _LEN.unpack(self._head)
            if n > MAX_MESSAGE:
                raise FrameError(413, f"a message of {n} bytes (at most {MAX_MESSAGE})")
            self._size = n
        else:
            self._body += data
        if len(self._body) < self._size:
            return None
        raw = bytes(self._body)
        self._head.clear()
        self._body.clear()
        self._size = None
        return self._decode(raw)


def decode_object(raw: bytes, expected: str = "a JSON object") -> dict[str, Any]:
    """A frame's JSON: an object; FrameError (saying `expected`) for anything else."""
    try:
        message = json.loads(raw)
    except RecursionError:  # json's scanner recurses per `[` or `{`; 64 KiB of them is deep
        raise FrameError(400, f"expected {expected}, got a message nested too deep") from None
    except ValueError as exc:  # also UnicodeDecodeError, and integers over Python's digit cap
        raise FrameError(
            400, f"expected {expected}, got a message that is not JSON ({exc})"
        ) from None
    if not isinstance(message, dict):
        raise FrameError(400, f"expected {expected}, got a JSON {type(message).__name__}")
    return message


def decode_message(raw: bytes) -> dict[str, Any]:
    """A request's JSON: an object of at most MAX_FIELDS fields, each a string, number, true,
    false or null; FrameError for anything else."""
    message = decode_object(raw, _FLAT)
    if len(message) > MAX_FIELDS or any(isinstance(v, (dict, list)) for v in message.values()):
        raise FrameError(400, f"expected {_FLAT}, got {len(message)} fields or nested values")
    return message


def descriptors(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors a message's SCM_RIGHTS ancillary data carried."""
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds += [int.from_bytes(payload[i : i + 4], "little") for i in range(0, usable, 4)]
    return fds


def send_frame(sock: socket.socket, message: dict[str, Any] | bytes, fd: int | None = None) -> None:
    """Blocking send of one message (or of a frame `encode_frame` made), with `fd` passed
    alongside when given."""
    data = message if isinstance(message, bytes) else encode_frame(message)
    if fd is None:
        sock.sendall(data)
        return
    sent = socket.send_fds(sock, [data], [fd])
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_frame(
    sock: socket.socket,
    deadline: float | None = None,
    decode: Callable[[bytes], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Blocking receive of one message (no descriptors are expected this way), through a
    `FrameReader(decode)`: FrameError for an oversized frame (before its bytes are read) or a
    malformed one, ConnectionError when the socket closes first. With a `deadline`
    (`time.monotonic()`), the whole frame must come by then (TimeoutError), however the bytes
    are spread."""
    reader = FrameReader(decode)
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no whole frame by the deadline")
            sock.settimeout(left)
        chunk = sock.recv(reader.wanted())
        if not chunk:
            raise ConnectionError("the region socket closed")
        message = reader.feed(chunk)
        if message is not None:
            return message


#: struct ucred: pid, uid, gid
_PEERCRED = struct.Struct("3i")


def peer_uid(fd: int) -> int | None:
    """The uid of the process at the other end of the Unix socket `fd` (SO_PEERCRED): the client
    its regions and calls are counted to; None where the kernel does not say."""
    sock = socket.socket(fileno=fd)
    try:
        _, uid, _ = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except OSError:
        return None
    finally:
        sock.detach()
    return int(uid)


def listen(path: str) -> socket.socket:
    """A non-blocking Unix socket listening on `path`: its folder is made owner-only when
    created here (a folder others may write to, or of another user's, is refused), the socket
    is owner-only, and a stale socket file left by a killed server is replaced."""
    folder = Path(path).parent
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
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)  # the socket is created 0600, never briefly wider
        try:
            listener.bind(path)
        finally:
            os.umask(old)
        listener.listen(64)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener
