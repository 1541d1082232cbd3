"""Attacks on a real server and the legitimate client that must get through them
(CONTRACT.md, "Abuse"): the attacks connect from 127.0.0.1, the legitimate client from
127.0.0.2, so the door tells them apart as it tells two hosts apart."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import httpx

from tests.service.bodies import OCTET, body_of, good_tensors
from tests.service.raw import address, prefill_head
from tests.service.servers import Server

#: the legitimate client's address (the attacks come from 127.0.0.1, the server's)
OTHER = "127.0.0.2"
LOCKOUT_S = 15.0  # the contract's bound on a legitimate request's wait during an attack


def other_client(server: Server) -> httpx.Client:
    """An HTTP client the service tells apart from the attacks' (which come from 127.0.0.1):
    its connections come from `OTHER`."""
    if server.uds:
        return server.client()
    transport = httpx.HTTPTransport(local_address=OTHER)
    return httpx.Client(base_url=server.url, transport=transport, timeout=120)


def legitimate(server: Server) -> float:
    """Seconds a correct /prefill took, retrying 429/503 as a client would, within LOCKOUT_S;
    the answer is checked (a 200 whose `out` has the right shape). It comes from another
    address than the attacks: a client of its own (a client alone may use every slot)."""
    tensors = good_tensors()
    body = body_of(tensors)
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < LOCKOUT_S:
        with other_client(server) as c:
            try:
                last = c.post("/prefill", content=body, headers=OCTET, timeout=LOCKOUT_S)
            except httpx.TransportError as exc:
                last = exc
                time.sleep(0.2)
                continue
        if last.status_code == 200:
            assert len(last.content) > tensors["q"].shape[0] * 128
            return time.monotonic() - t0
        assert last.status_code in (429, 503), last.text
        time.sleep(0.2)
    raise AssertionError(f"locked out for {LOCKOUT_S} s: {last!r}")


def during(attack: Callable[[threading.Event], None], server: Server, settle_s: float) -> list:
    """Legitimate requests' latencies (s), one every 0.5 s for a few seconds, while `attack`
    runs in a thread (it stops when the event is set)."""
    stop = threading.Event()
    t = threading.Thread(target=attack, args=(stop,), daemon=True)
    t.start()
    try:
        time.sleep(settle_s)
        waits = []
        for _ in range(4):
            waits.append(legitimate(server))
            time.sleep(0.5)
        # the README's robustness table quotes these (pytest -s shows them)
        print(
            f"\n{os.environ.get('PYTEST_CURRENT_TEST', '?')}: legitimate request waited",
            ", ".join(f"{w * 1e3:.0f} ms" for w in waits),
        )
        return waits
    finally:
        stop.set()
        t.join(30)


def silent_heads(server: Server, head: bytes, n: int, stop: threading.Event) -> None:
    """`n` connections that send `head` (announcing a body) and then nothing, reconnecting
    whenever the server closes one, until `stop`."""
    socks: list[socket.socket | None] = [None] * n
    try:
        while not stop.is_set():
            for i in range(n):
                s = socks[i]
                if s is not None:
                    s.settimeout(0)
                    try:
                        if s.recv(65536) == b"":
                            raise ConnectionError
                        continue  # answered: read on until it closes
                    except BlockingIOError:
                        continue
                    except OSError:
                        s.close()
                try:
                    s = socket.create_connection(address(server), timeout=5)
                    s.sendall(head)
                    socks[i] = s
                except OSError:
                    socks[i] = None
            stop.wait(0.1)
    finally:
        for s in socks:
            if s is not None:
                s.close()


def trickle(server: Server, announce: int, n: int, rate: float, stop: threading.Event) -> None:
    """`n` uploads announcing `announce` bytes each, sent at `rate` bytes/s (above the 1 MB/s
    minimum), reconnecting whenever the server cuts one off, until `stop`."""
    socks: list[tuple[socket.socket, float, int] | None] = [None] * n
    step = 0.05
    try:
        while not stop.is_set():
            for i in range(n):
                entry = socks[i]
                if entry is None:
                    try:
                        s = socket.create_connection(address(server), timeout=5)
                        s.sendall(prefill_head(announce))
                        entry = socks[i] = (s, time.monotonic(), 0)
                    except OSError:
                        continue
                s, t0, sent = entry
                due = int((time.monotonic() - t0) * rate) - sent
                try:
                    s.setblocking(False)
                    if s.recv(1 << 16, socket.MSG_PEEK):
                        raise ConnectionError  # answered (408, 429): start again
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    socks[i] = None
                    continue
                try:
                    s.setblocking(True)
                    s.settimeout(1)
                    if due > 0:
                        s.sendall(bytes(due))
                        socks[i] = (s, t0, sent + due)
                except OSError:
                    s.close()
                    socks[i] = None
            stop.wait(step)
    finally:
        for entry in socks:
            if entry is not None:
                entry[0].close()
