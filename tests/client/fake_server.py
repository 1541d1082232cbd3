"""Hostile servers written by hand, for the client's tests: a loopback HTTP/1.1 server whose
answers are raw bytes a test writes to the socket (trickled, lying, chunked, wrong), one that
keeps connections alive and closes them as the service does at its connection cap, one that
takes requests and answers none until woken, a listener whose connects hang, and a region
socket whose replies are raw frames."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Self

import torch
from safetensors.torch import load, save

import zen_mla
from service.problems import problem_bytes
from zen_mla import RequestTimeoutError

__all__ = [
    "Act",
    "FakeRegionSocket",
    "FakeServer",
    "FullBacklog",
    "KeepAliveServer",
    "Request",
    "SilentServer",
    "answer",
    "chunked",
    "closed",
    "displaced",
    "frame",
    "prefill_answer",
    "read_then",
    "reset",
    "response",
    "safetensors_body",
    "trickle",
]


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes


def response(
    status: int, body: bytes = b"", headers: dict[str, str] | None = None, length: bool = True
) -> bytes:
    """A whole HTTP/1.1 answer; `length=False` leaves Content-Length out (the body then ends
    when the connection closes, unless `headers` say chunked)."""
    lines = [f"HTTP/1.1 {status} X", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def chunked(body: bytes, size: int = 1000) -> bytes:
    parts = [
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


def safetensors_body(tensors: dict[str, torch.Tensor]) -> bytes:
    return save(tensors, {"kernel": "fake"})


def trickle(conn: socket.socket, data: bytes, every: float, stop: threading.Event) -> None:
    """One byte of `data` every `every` seconds, until sent, the peer goes or the server stops."""
    for i in range(len(data)):
        if stop.wait(every):
            return
        conn.sendall(data[i : i + 1])


def _read_request(conn: socket.socket) -> Request:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the client went")
        head += chunk
    head, _, body = head.partition(b"\r\n\r\n")
    first, *lines = head.decode("latin-1").split("\r\n")
    method, path, _ = first.split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = conn.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the client went")
        body += chunk
    return Request(method, path, headers, body)


class _Listener:
    """A listening socket served by a thread: each connection is handled by `_handle` in a
    thread of its own until `close()`."""

    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener
        self._listener.settimeout(0.05)
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self._listener.close()
        self._thread.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FakeServer(_Listener):
    """Answers each request (one per connection) with `answer(request, conn, stop)`, which
    writes whatever bytes it likes; `requests` lists what came."""

    def __init__(self, answer: Callable[[Request, socket.socket, threading.Event], None]) -> None:
        self._answer = answer
        listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self.requests: list[Request] = []
        super().__init__(listener)

    def _handle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(30)
            request = _read_request(conn)
            self.requests.append(request)
            self._answer(request, conn, self.stop)
            # let the client read to the end before the close (a close with unread data resets)
            conn.shutdown(socket.SHUT_WR)
            while not self.stop.is_set() and conn.recv(65536):
                pass


def prefill_answer(request: Request) -> bytes:
    """A keep-alive 200 to a /prefill request: `zen_mla.ragged_attention` of what it holds."""
    n = int.from_bytes(request.body[:8], "little")
    meta = json.loads(request.body[8 : 8 + n]).get("__metadata__", {})
    t = load(request.body)
    result = zen_mla.ragged_attention(
        t["q"], t["k"], t["v"], t["q_cu_seq_lens"], t.get("kv_cu_seq_lens"),
        causal=meta.get("causal", "true") == "true",
        return_lse=meta.get("return_lse") == "true",
        scale=float(meta["scale"]) if "scale" in meta else None,
    )  # fmt: skip
    out, lse = result if isinstance(result, tuple) else (result, None)
    body = safetensors_body({"out": out} | ({} if lse is None else {"lse": lse}))
    head = ["HTTP/1.1 200 OK", "Content-Type: application/octet-stream"]
    head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class SilentServer(_Listener):
    """Accepts connections at `host`:`port` (0: any free one; `url`) and reads a request on
    each, answering none until `wake()`: from then on each request, held or new, is answered
    (`/health/ready` 200, a prefill `prefill_answer`'s). `events` lists ("came" or
    "answered", path) in order."""

    def __init__(self, host: str, port: int) -> None:
        self.woken = threading.Event()
        self.events: list[tuple[str, str]] = []
        self._lock = threading.Lock()  # guards events
        listener = socket.create_server((host, port))
        self.url = f"http://{host}:{listener.getsockname()[1]}"
        super().__init__(listener)

    def _note(self, what: str, path: str) -> None:
        with self._lock:
            self.events.append((what, path))

    def _handle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(30)
            request = _read_request(conn)
            self._note("came", request.path)
            while not self.woken.wait(0.05):
                if self.stop.is_set():
                    return
            if request.path == "/prefill":
                conn.sendall(prefill_answer(request))
            else:
                conn.sendall(response(200, b'{"status": "ok"}'))
            self._note("answered", request.path)
            conn.shutdown(socket.SHUT_WR)
            while not self.stop.is_set() and conn.recv(65536):
                pass

    def wake(self) -> None:
        self.woken.set()

    def seen(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.events)


class FullBacklog:
    """A socket listening at `host`:`port` (0: any free one; `url`) that accepts nothing, its
    backlog (of one) taken by a connection of its own: a connect there hangs, its SYNs
    dropped, until the connecting side gives up."""

    def __init__(self, host: str, port: int) -> None:
        self._listener = socket.socket()
        self._listener.bind((host, port))
        self._listener.listen(0)
        port = self._listener.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self._filler = socket.create_connection((host, port), timeout=5)

    def close(self) -> None:
        self._filler.close()
        self._listener.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# What a KeepAliveServer does with a request: True to keep the connection for the next one.
Act = Callable[[socket.socket, threading.Event], bool]


def answer(conn: socket.socket, stop: threading.Event) -> bool:
    """The request read and answered (`prefill_answer`), the connection kept."""
    conn.sendall(prefill_answer(_read_request(conn)))
    return True


def displaced(conn: socket.socket, stop: threading.Event) -> bool:
    """The service's 408 for an idle connection it closes at its connection cap
    (service/protocol.py), written once the request's bytes came, none of them read; the
    input then dropped until the client closes (no reset: the client reads the 408)."""
    t = 10.0  # the service's default header timeout, named in its message
    exc = RequestTimeoutError(
        "no request came on this connection while others waited for one "
        f"(the connection cap is reached; idle ones are closed, at most {t} s)"
    )
    conn.sendall(problem_bytes(exc))
    _linger(conn, stop)
    return False


def closed(conn: socket.socket, stop: threading.Event) -> bool:
    """The connection closed (a FIN) once the request's bytes came, none of them read (the
    client reads the end before any answer); the input then dropped until the client closes."""
    _linger(conn, stop)
    return False


def reset(conn: socket.socket, stop: threading.Event) -> bool:
    """The connection reset once the request's bytes came, none of them read."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return False


def read_then(raw: bytes, *, then_reset: bool = False) -> Act:
    """The request read whole, `raw` written, then the connection closed (reset, with
    `then_reset`; else a FIN, the input dropped until the client closes)."""

    def act(conn: socket.socket, stop: threading.Event) -> bool:
        _read_request(conn)
        conn.sendall(raw)
        if then_reset:
            return reset(conn, stop)
        _linger(conn, stop)
        return False

    return act


def _linger(conn: socket.socket, stop: threading.Event) -> None:
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(0.05)
    while not stop.is_set():
        try:
            if not conn.recv(65536):
                return
        except TimeoutError:
            continue


class KeepAliveServer(_Listener):
    """Keeps connections alive: request `r` on connection `c` (each counted from 0, connections
    in the order they came) is handled by `act(c, r)` once its first bytes came (`answer`,
    `displaced`, `closed`, `reset`, or any `Act`); `arrived` lists each such (c, r)."""

    def __init__(self, act: Callable[[int, int], Act]) -> None:
        self._act = act
        listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self.arrived: list[tuple[int, int]] = []
        self._connections = 0
        self._lock = threading.Lock()  # guards _connections and arrived
        super().__init__(listener)

    def _handle(self, conn: socket.socket) -> None:
        with self._lock:
            c, self._connections = self._connections, self._connections + 1
        with conn, contextlib.suppress(OSError):
            for r in itertools.count():
                conn.settimeout(0.05)
                while True:  # until the request's first bytes came, none of them taken
                    if self.stop.is_set():
                        return
                    try:
                        if not conn.recv(1, socket.MSG_PEEK):
                            return  # the client closed it
                        break
                    except TimeoutError:
                        continue
                with self._lock:
                    self.arrived.append((c, r))
                conn.settimeout(30)
                if not self._act(c, r)(conn, self.stop):
                    return

    def sends(self) -> int:
        """Requests whose bytes came, so far."""
        with self._lock:
            return len(self.arrived)


def frame(message: Any) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">I", len(data)) + data


class FakeRegionSocket(_Listener):
    """A region socket on a Unix path: each message (descriptors taken and closed) is answered
    by `reply(message, conn, stop)`, which writes whatever bytes it likes."""

    def __init__(
        self, reply: Callable[[dict[str, Any], socket.socket, threading.Event], None]
    ) -> None:
        self._reply = reply
        self._dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self._dir.name, "regions.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen()
        super().__init__(listener)

    def _handle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, ValueError):
            conn.settimeout(0.1)
            buf = b""
            while not self.stop.is_set():
                try:
                    data, fds, _, _ = socket.recv_fds(conn, 65536, 4)
                except TimeoutError:
                    continue
                for fd in fds:
                    os.close(fd)
                if not data:
                    return
                buf += data
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                    n = struct.unpack(">I", buf[:4])[0]
                    message, buf = json.loads(buf[4 : 4 + n]), buf[4 + n :]
                    self._reply(message, conn, self.stop)

    def close(self) -> None:
        super().close()
        self._dir.cleanup()


@contextlib.contextmanager
def elapsed() -> Iterator[list[float]]:
    """`with elapsed() as t: ...`, then `t[0]` is the block's seconds."""
    box: list[float] = []
    start = time.monotonic()
    try:
        yield box
    finally:
        box.append(time.monotonic() - start)
