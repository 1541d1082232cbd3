"""The same-host region socket's messages: a 4-byte big-endian length, then a JSON object of a
few flat fields; a `register` message carries one descriptor (SCM_RIGHTS) in the same `sendmsg`.

    client                                   service
    {"op": "hello", "token": "..."}    ->    {"ok": true, "max_regions": 64, "max_bytes": ...}
    {"op": "register"} + memfd         ->    {"ok": true, "region": "<handle>", "nbytes": N}
    {"op": "unregister", "region": h}  ->    {"ok": true}
    anything wrong                     ->    {"ok": false, "status": 4xx, "error": "..."}

`hello` comes first, also without a token. One request at a time per connection; the reply
comes before the next request is read. Closing the connection ends every region registered
over it.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

__all__ = [
    "MAX_FIELDS",
    "MAX_MESSAGE",
    "FrameError",
    "FrameReader",
    "encode_frame",
    "recv_frame",
    "send_frame",
]

MAX_MESSAGE = 64 << 10
MAX_FIELDS = 16
_LEN = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that breaks the protocol; `status` is the refusal's (the connection then ends)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def encode_frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _LEN.pack(len(data)) + data


class FrameReader:
    """Bytes in, whole messages out, one frame at a time: `wanted()` is how many bytes to read
    next, never past the frame being read, so a reader holds at most one frame (and a read never
    takes the next frame's descriptor)."""

    def __init__(self) -> None:
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
        return decode_message(raw)


def decode_message(raw: bytes) -> dict[str, Any]:
    """A message's JSON: an object of at most MAX_FIELDS fields, each a string, number, true,
    false or null; FrameError for anything else."""
    flat = f"a JSON object of at most {MAX_FIELDS} fields, each a string, number, bool or null"
    try:
        message = json.loads(raw)
    except RecursionError:  # json's scanner recurses per `[` or `{`; 64 KiB of them is deep
        raise FrameError(400, f"expected {flat}, got a message nested too deep") from None
    except ValueError as exc:  # also UnicodeDecodeError, and integers over Python's digit cap
        raise FrameError(400, f"expected {flat}, got a message that is not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise FrameError(400, f"expected {flat}, got a JSON {type(message).__name__}")
    if len(message) > MAX_FIELDS or any(isinstance(v, (dict, list)) for v in message.values()):
        raise FrameError(400, f"expected {flat}, got {len(message)} fields or nested values")
    return message


def send_frame(sock: socket.socket, message: dict[str, Any], fd: int | None = None) -> None:
    """Blocking send of one message, with `fd` passed alongside when given."""
    data = encode_frame(message)
    if fd is None:
        sock.sendall(data)
        return
    sent = socket.send_fds(sock, [data], [fd])
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """Blocking receive of one message (no descriptors are expected this way)."""
    reader = FrameReader()
    while True:
        chunk = sock.recv(reader.wanted())
        if not chunk:
            raise ConnectionError("the region socket closed")
        message = reader.feed(chunk)
        if message is not None:
            return message
