"""Attacks on a real server and the legitimate client that must get through them
(docs/protocol.md, "Limits"): the attacks connect from 127.0.0.1, the legitimate client from
127.0.0.2, so the door tells them apart as it tells two hosts apart; `during` times a
legitimate client's rounds (HTTP here, or the region socket's) while an attack runs."""

from __future__ import annotations

import functools
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import safetensors.torch
import torch

import zen_mla
from tests.processes import open_fds
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


@functools.cache
def _legitimate_request(upload: bool) -> tuple[bytes, torch.Tensor]:
    tensors = good_tensors()
    if upload:  # 2 MiB: a body that needs an upload slot
        g = torch.Generator().manual_seed(7)
        q, k = (torch.randn(256, 8, 192, generator=g).bfloat16() for _ in range(2))
        v = torch.randn(256, 8, 128, generator=g).bfloat16()
        tensors = {"q": q, "k": k, "v": v, "q_cu_seq_lens": torch.tensor([0, 200, 256])}
    expected = zen_mla.ragged_attention(
        tensors["q"], tensors["k"], tensors["v"], tensors["q_cu_seq_lens"]
    )
    assert isinstance(expected, torch.Tensor)
    return body_of(tensors), expected


def legitimate(server: Server, upload: bool = False) -> float:
    """Seconds a correct /prefill took, retrying 429/503 as a client would, within LOCKOUT_S;
    the answer is checked against in-process `ragged_attention`. It comes from another
    address than the attacks: a client of its own (a client alone may use every slot).
    `upload`: a body large enough to need an upload slot (a small one needs none)."""
    body, expected = _legitimate_request(upload)
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
            out = safetensors.torch.load(last.content)["out"]
            torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
            return time.monotonic() - t0
        assert last.status_code in (429, 503), last.text
        time.sleep(0.2)
    raise AssertionError(f"locked out for {LOCKOUT_S} s: {last!r}")


@dataclass
class Latencies:
    seconds: list[float]  # each legitimate round's
    peak_fds: int  # the server's open descriptors, at most, while the attack ran

    def __str__(self) -> str:
        s = sorted(self.seconds)
        return (
            f"{len(s)} rounds, median {statistics.median(s):.3f} s, "
            f"p90 {s[int(0.9 * (len(s) - 1))]:.3f} s, max {s[-1]:.3f} s, "
            f"server fds at most {self.peak_fds}"
        )


def during(
    attack: Callable[[threading.Event], None],
    server: Server,
    legit: Callable[[], float],
    *,
    settle_s: float,
    rounds: int = 3,
    seconds: float = 0.0,
    pause_s: float = 0.0,
) -> Latencies:
    """The seconds of legitimate rounds (`legit()` says how long its round took), run one after
    another while `attack(stop)` runs in a thread, started `settle_s` before the first round
    (time for the attack to take hold): `rounds` at least, `pause_s` apart, for `seconds` at
    least. Each round must come within LOCKOUT_S; an exception in the attack is raised here.
    The server's open descriptors are watched meanwhile (`peak_fds`)."""
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            attack(stop)
        except BaseException as exc:  # reported in the test's thread
            failure.append(exc)

    pid = server.process.pid
    peak = [open_fds(pid)]

    def watch() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], open_fds(pid))

    attacker = threading.Thread(target=run, daemon=True)
    watcher = threading.Thread(target=watch, daemon=True)
    attacker.start()
    watcher.start()
    took: list[float] = []
    try:
        time.sleep(settle_s)
        end = time.monotonic() + seconds
        while len(took) < rounds or time.monotonic() < end:
            took.append(legit())
            assert took[-1] < LOCKOUT_S, f"a legitimate round took {took[-1]:.1f} s"
            time.sleep(pause_s)
    finally:
        stop.set()
        attacker.join(30)
        watcher.join(30)
    assert not failure, failure
    latencies = Latencies(took, peak[0])
    print(f"\n{os.environ.get('PYTEST_CURRENT_TEST', '?')}: {latencies}")  # shown by pytest -s
    return latencies


def silent_heads(
    server: Server,
    head: bytes,
    n: int,
    stop: threading.Event,
    sources: list[str] | None = None,
    poll_s: float = 0.1,
) -> None:
    """`n` connections that send `head` (announcing a body) and then nothing, reconnecting
    whenever the server closes one (looking every `poll_s`), until `stop`; connection i from
    `sources[i % len]` where given (loopback addresses: one client each, as hosts would be)."""
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
                    source = None if sources is None else (sources[i % len(sources)], 0)
                    s = socket.create_connection(address(server), 5, source)
                    s.sendall(head)
                    socks[i] = s
                except OSError:
                    socks[i] = None
            stop.wait(poll_s)
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
