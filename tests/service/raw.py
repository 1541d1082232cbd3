"""Raw HTTP/1.1 on a socket, for the tests that attack the service as no library client would:
heads without bodies, bodies that trickle, answers read to the close."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from urllib.parse import urlparse

from tests.service.servers import Server

MIB = 1 << 20


def address(server: Server) -> tuple[str, int]:
    url = urlparse(server.url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


def prefill_head(n: int, extra: bytes = b"") -> bytes:
    return (
        b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
        + f"Content-Length: {n}\r\n".encode()
        + extra
        + b"\r\n"
    )


def read_answer(s: socket.socket, seconds: float) -> bytes:
    """What the server sends until it closes the connection, or for at most `seconds`."""
    s.settimeout(0.1)
    data = b""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            part = s.recv(65536)
        except TimeoutError:
            continue
        if not part:
            break
        data += part
    return data


def status(raw: bytes) -> int:
    assert raw.startswith(b"HTTP/1.1 "), raw[:200]
    return int(raw.split(b" ", 2)[1])


def assert_problem(raw: bytes, code: int) -> dict:
    assert status(raw) == code, raw[:300]
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"content-type: application/problem+json" in head.lower(), head
    problem = json.loads(body)
    assert problem["status"] == code and problem["detail"], problem
    return problem


def send_quietly(s: socket.socket, data: bytes) -> None:
    """sendall, where the server may close before taking everything (it answered already)."""
    with contextlib.suppress(OSError):
        s.sendall(data)
