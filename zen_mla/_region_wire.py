"""The same-host region socket's messages: a 4-byte big-endian length, then a JSON object; a
`register` message carries one descriptor (SCM_RIGHTS) in the same `sendmsg`.

    client                                   service
    {"op": "hello", "token": "..."}    ->    {"ok": true, "max_regions": 64, "max_bytes": ...}
    {"op": "register"} + memfd         ->    {"ok": true, "region": "<handle>", "nbytes": N}
    {"op": "unregister", "region": h}  ->    {"ok": true}
    anything wrong                     ->    {"ok": false, "status": 4xx, "error": "..."}

One request at a time per connection; the reply comes before the next request is read. Closing
the connection ends every region registered over it.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

__all__ = ["MAX_MESSAGE", "FrameReader", "encode_frame", "recv_frame", "send_frame"]

MAX_MESSAGE = 64 << 10
_LEN = struct.Struct(">I")


def encode_frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _LEN.pack(len(data)) + data


class FrameReader:
    """Bytes (and descriptors) in, whole messages out; for a non-blocking reader."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next(self) -> dict[str, Any] | None:
        """The next whole message, None until one has arrived; ValueError for a malformed or
        oversized one (the connection is then closed)."""
        if len(self._buf) < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(self._buf)
        if n > MAX_MESSAGE:
            raise ValueError(f"a message of {n} bytes (at most {MAX_MESSAGE})")
        if len(self._buf) < _LEN.size + n:
            return None
        raw = bytes(self._buf[_LEN.size : _LEN.size + n])
        del self._buf[: _LEN.size + n]
        message = json.loads(raw)
        if not isinstance(message, dict):
            raise ValueError("a message that is not a JSON object")
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
    while (message := reader.next()) is None:
        chunk = sock.recv(MAX_MESSAGE)
        if not chunk:
            raise ConnectionError("the region socket closed")
        reader.feed(chunk)
    return message
