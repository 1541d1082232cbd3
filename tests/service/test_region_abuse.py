"""Region-socket clients that misbehave (docs/protocol.md, "Limits"), against a real server with a
token: while each one runs, a client with the token registers a region and has a prefill
through it answered correctly, most rounds within 1 s and every one within 15 s."""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import struct
import threading
from collections.abc import Callable, Iterator

import pytest

from tests.processes import open_fds, wait_for
from tests.service.attacks import Latencies, during
from tests.service.region_clients import legit_round, region_socket
from tests.service.servers import Server, serve, server_fixture
from zen_mla.regions.protocol import recv_frame

pytestmark = pytest.mark.slow
TOKEN = "s3cret"
HELLO_TIMEOUT_S = 5.0  # RegionServer's default
ATTACK_S = 4.0


@server_fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 4096 descriptors: an attack that hoards them runs the server out within the test's time
    with serve(
        tmp_path_factory.mktemp("region_abuse"), workers=1, api_token=TOKEN, nofile=(4096, 4096)
    ) as s:
        yield s


def _during(attack: Callable[[threading.Event], None], server: Server, path: str) -> Latencies:
    """Rounds of a client with the token (hello, register, prefill) for ATTACK_S while `attack`
    runs (attacks.during: each within 15 s); most of them within 1 s."""
    latencies = during(
        attack, server, lambda: legit_round(server, path, TOKEN), settle_s=0.5, seconds=ATTACK_S
    )
    assert statistics.median(latencies.seconds) < 1, latencies
    return latencies


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def _closed_by_server(s: socket.socket) -> bool:
    """The server closed `s` (it may have sent a refusal first); never waits."""
    s.setblocking(False)  # with a timeout, Python polls for it before recv, MSG_DONTWAIT or not
    try:
        while s.recv(1 << 16):
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.settimeout(5)
    return True


def test_descriptors_sent_before_hello_are_not_hoarded(guarded):
    """A frame's length, then 1 byte and 4 descriptors per sendmsg, never finishing the frame:
    the server drops the connection at the first descriptor, keeping none."""
    path = region_socket(guarded)
    memfd = os.memfd_create("hoard", os.MFD_CLOEXEC)
    sends = [0]

    def hoard(stop: threading.Event) -> None:
        while sends[0] < 5000 and not stop.is_set():
            with contextlib.suppress(OSError), _connect(path) as s:
                s.sendall(struct.pack(">I", 60000))
                while sends[0] < 5000 and not stop.is_set():
                    socket.send_fds(s, [b"["], [memfd] * 4)
                    sends[0] += 1
                stop.wait()  # hold whatever the server kept until the test ends
        stop.wait()

    before = open_fds(guarded.process.pid)
    try:
        latencies = _during(hoard, guarded, path)
    finally:
        os.close(memfd)
    assert sends[0] > 100, sends
    assert latencies.peak_fds < before + 100, (before, latencies)
    assert guarded.health()["status"] == "ok"


def test_silent_connections_do_not_lock_out_clients_with_the_token(guarded):
    """64 connections that never say hello: they are capped apart (the oldest closed), so no
    region-client place is theirs."""
    path = region_socket(guarded)
    opened = [0]

    def silent(stop: threading.Event) -> None:
        held: list[socket.socket] = []
        try:
            while not stop.is_set() and opened[0] < 2000:
                for s in [s for s in held if _closed_by_server(s)]:
                    held.remove(s)
                    s.close()
                while len(held) < 64 and opened[0] < 2000:
                    held.append(_connect(path))
                    opened[0] += 1
                stop.wait(0.05)
        finally:
            for s in held:
                s.close()

    _during(silent, guarded, path)
    assert opened[0] >= 64


def test_connections_that_never_say_hello_are_closed_after_the_hello_deadline(guarded):
    path = region_socket(guarded)
    silent = [_connect(path) for _ in range(64)]
    try:
        wait_for(
            lambda: all(_closed_by_server(s) for s in silent),
            HELLO_TIMEOUT_S + 5,
            "a connection outlived the hello deadline",
            0.1,
        )
    finally:
        for s in silent:
            s.close()


def test_a_deeply_nested_frame_gets_an_error_and_is_closed(guarded):
    """60,000 nested `[` in one frame: a 400 and the connection closed (no RecursionError in
    the event loop's callback, no client place held)."""
    path = region_socket(guarded)
    frame = struct.pack(">I", 60000) + b"[" * 60000
    answered = [0]

    def nest(stop: threading.Event) -> None:
        while not stop.is_set() and answered[0] < 500:
            with _connect(path) as s:
                s.sendall(frame)
                reply = recv_frame(s)
                assert not reply["ok"] and reply["status"] == 400, reply
                assert s.recv(1) == b""
            answered[0] += 1

    _during(nest, guarded, path)
    assert answered[0] > 0
