"""The region registry's limits and checks, the region socket's frames, and its door rules
(hello and frame deadlines, caps, descriptors), with real memfds and a RegionServer on a loop
in this process (no service)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.memfds import UNMAPPABLE
from tests.processes import wait_for
from tests.regions.region_sockets import refused, running
from zen_mla import InvalidInputError
from zen_mla.pool import SharedBuffer
from zen_mla.regions.memfd import create_sealed_memfd
from zen_mla.regions.protocol import (
    MAX_FIELDS,
    FrameError,
    FrameReader,
    encode_frame,
    recv_frame,
    send_frame,
)
from zen_mla.regions.registry import RegionRegistry
from zen_mla.regions.server import RegionServer
from zen_mla.wire.regions_json import TensorPlace


def test_per_client_limits_and_handles():
    registry = RegionRegistry(max_regions=2, max_bytes=3 << 16, adopt=SharedBuffer.adopt)
    held: dict = {}
    a = registry.register(create_sealed_memfd(1 << 16), held)
    b = registry.register(create_sealed_memfd(1 << 16), held)
    assert len(a.handle) >= 24 and a.handle != b.handle and len(registry) == 2
    with pytest.raises(InvalidInputError, match="at most 2 regions"):
        registry.register(create_sealed_memfd(1 << 10), held)
    registry.unregister(b.handle, held)
    with pytest.raises(InvalidInputError, match="bytes of regions"):
        registry.register(create_sealed_memfd(3 << 16), held)
    other: dict = {}
    with pytest.raises(InvalidInputError, match="this client registered"):
        registry.unregister(a.handle, other)  # another client's handle
    t = registry.tensor("q", TensorPlace(a.handle, 64, "BF16", (4, 2)), ("BF16",))
    assert t.shape == (4, 2) and t.dtype == torch.bfloat16
    assert t.data_ptr() == a.buffer.base + 64
    registry.drop(held)
    with pytest.raises(InvalidInputError, match="registered region"):
        registry.resolve(a.handle)


def test_places_are_checked_against_their_region():
    registry = RegionRegistry(max_regions=4, max_bytes=1 << 30, adopt=SharedBuffer.adopt)
    region = registry.register(create_sealed_memfd(4096), {})
    h = region.handle
    with pytest.raises(InvalidInputError, match="past its end by 64"):
        registry.tensor("q", TensorPlace(h, 4096 - 64, "F32", (32,)), ("F32",))
    with pytest.raises(InvalidInputError, match="multiple of 4"):
        registry.tensor("q", TensorPlace(h, 2, "F32", (1,)), ("F32",))
    with pytest.raises(InvalidInputError, match="one of I32, I64"):
        registry.tensor("q_cu_seq_lens", TensorPlace(h, 0, "F32", (2,)), ("I32", "I64"))
    with pytest.raises(InvalidInputError, match="overlapping"):
        registry.check_disjoint(
            {"q": TensorPlace(h, 0, "F32", (8,)), "out": TensorPlace(h, 28, "F32", (8,))},
            ("out",),
        )
    registry.check_disjoint(
        {"q": TensorPlace(h, 0, "F32", (8,)), "out": TensorPlace(h, 32, "F32", (8,))}, ("out",)
    )


def test_two_handles_of_one_memfd_are_one_memory_for_overlaps():
    registry = RegionRegistry(max_regions=4, max_bytes=1 << 30, adopt=SharedBuffer.adopt)
    fd = create_sealed_memfd(4096)
    try:
        a = registry.register(os.dup(fd), {})
        b = registry.register(os.dup(fd), {})  # another client's
    finally:
        os.close(fd)
    c = registry.register(create_sealed_memfd(4096), {})
    assert a.memory == b.memory != c.memory
    q = TensorPlace(a.handle, 0, "F32", (8,))
    with pytest.raises(InvalidInputError, match=r"out: .*q: \[0, 32\), same memfd"):
        registry.check_disjoint({"q": q, "out": TensorPlace(b.handle, 16, "F32", (8,))}, ("out",))
    registry.check_disjoint({"q": q, "out": TensorPlace(c.handle, 0, "F32", (8,))}, ("out",))


@pytest.mark.parametrize("case", UNMAPPABLE.values(), ids=UNMAPPABLE.keys())
def test_a_memfd_that_cannot_be_mapped_is_invalid_input(case):
    make, says = case
    registry = RegionRegistry(max_regions=4, max_bytes=1 << 30, adopt=SharedBuffer.adopt)
    held: dict = {}
    with pytest.raises(InvalidInputError, match=says):
        registry.register(make(), held)
    assert not held and len(registry) == 0


# -- frames -------------------------------------------------------------------------------------

BAD_FRAMES = {
    "nested_60000": (b"[" * 60000, "nested too deep"),
    "nested_objects": (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nested too deep"),
    "an_array": (b"[]", "JSON list"),
    "a_string": (b'"hello"', "JSON str"),
    "nested_value": (b'{"op": "hello", "token": ["x"]}', "nested values"),
    "too_many_fields": (json.dumps({str(i): i for i in range(MAX_FIELDS + 1)}).encode(), "17"),
    "not_utf8": (b"\xff\xfe", "not JSON"),
    "digits_past_the_cap": (b'{"op": ' + b"9" * 5000 + b"}", "not JSON"),
    "empty": (b"", "not JSON"),
}


def _frame(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw


@pytest.mark.parametrize("case", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_a_frame_that_is_not_a_flat_json_object_is_a_400(case):
    raw, says = case
    reader = FrameReader()
    with pytest.raises(FrameError, match=says) as caught:
        data = _frame(raw)
        while data:
            n = reader.wanted()
            reader.feed(data[:n])
            data = data[n:]
    assert caught.value.status == 400


def test_an_oversized_frame_is_refused_from_its_length():
    reader = FrameReader()
    with pytest.raises(FrameError, match="65537 bytes") as caught:
        reader.feed(struct.pack(">I", (64 << 10) + 1))
    assert caught.value.status == 413


scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=50))


@given(
    st.lists(st.dictionaries(st.text(max_size=8), scalars, max_size=MAX_FIELDS), max_size=4),
    st.lists(st.integers(1, 64), min_size=1),
)
def test_frames_come_out_whole_one_at_a_time_however_the_bytes_are_cut(messages, cuts):
    stream = b"".join(encode_frame(m) for m in messages)
    reader, got, i = FrameReader(), [], 0
    while stream:
        n = min(reader.wanted(), cuts[i % len(cuts)])  # a read never passes the frame's end
        i += 1
        message = reader.feed(stream[:n])
        stream = stream[n:]
        if message is not None:
            got.append(message)
    assert got == messages and not reader.started


# -- the door: hello, deadlines, caps, descriptors -----------------------------------------------


def test_connections_yet_to_say_hello_are_capped_oldest_out_and_timed(tmp_path):
    with running(tmp_path, token="t", hello_timeout_s=0.5, max_unauthenticated=2) as r:
        a, b, c = r.connect(), r.connect(), r.connect()
        assert refused(a)[0] == 503  # evicted at once by c
        for s in (b, c):
            status, waited = refused(s)
            assert status == 408 and waited < 2
        assert r.on_loop(lambda: r.server.waiting) == 0
        slow = r.connect()
        slow.sendall(encode_frame({"op": "hello", "token": "t"})[:6])  # a hello half sent
        assert refused(slow)[0] == 408
        for s in (a, b, c, slow):
            s.close()


def test_only_connections_that_said_hello_count_toward_max_clients(tmp_path):
    with running(tmp_path, token="t", max_clients=1) as r:
        silent = [r.connect() for _ in range(3)]
        first = r.connect()
        send_frame(first, {"op": "hello", "token": "t"})
        assert recv_frame(first)["ok"]
        second = r.connect()
        send_frame(second, {"op": "hello", "token": "t"})
        assert refused(second)[0] == 503
        wrong = r.connect()
        send_frame(wrong, {"op": "hello", "token": "nope"})
        assert refused(wrong)[0] == 401
        early = r.connect()
        send_frame(early, {"op": "unregister", "region": "x"})  # hello first, also without one
        assert refused(early)[0] == 401
        assert r.on_loop(lambda: (r.server.clients, r.server.waiting)) == (1, 3)
        for s in (*silent, first, second, wrong, early):
            s.close()


def test_a_half_sent_frame_is_closed_but_an_idle_client_stays(tmp_path):
    with running(tmp_path, frame_timeout_s=0.3, hello_timeout_s=0.3) as r:
        idle = r.connect()
        send_frame(idle, {"op": "hello"})
        assert recv_frame(idle)["ok"]
        time.sleep(0.8)  # past both deadlines, between frames
        send_frame(idle, {"op": "hello"})
        assert recv_frame(idle)["ok"]
        idle.sendall(encode_frame({"op": "unregister", "region": "x"})[:7])
        status, waited = refused(idle)
        assert status == 408 and waited < 2
        idle.close()


def test_descriptors_only_after_hello_one_a_frame_and_only_with_register(tmp_path):
    memfd = create_sealed_memfd(4096)
    with running(tmp_path) as r:
        early = r.connect()
        socket.send_fds(early, [encode_frame({"op": "hello"})], [memfd])
        assert refused(early)[0] == 400
        s = r.connect()
        send_frame(s, {"op": "hello"})
        assert recv_frame(s)["ok"]
        socket.send_fds(s, [encode_frame({"op": "unregister", "region": "x"})], [memfd])
        reply = recv_frame(s)
        assert reply["status"] == 422 and "only with register" in reply["error"]
        send_frame(s, {"op": "register"}, memfd)
        assert recv_frame(s)["ok"]  # the connection stayed
        socket.send_fds(s, [encode_frame({"op": "register"})], [memfd, memfd])
        assert refused(s)[0] == 400
        hoard = r.connect()
        send_frame(hoard, {"op": "hello"})
        assert recv_frame(hoard)["ok"]
        hoard.sendall(struct.pack(">I", 1000))
        socket.send_fds(hoard, [b"{"], [memfd])
        socket.send_fds(hoard, [b" "], [memfd])  # a second before the frame is whole
        assert refused(hoard)[0] == 400
        many = r.connect()
        send_frame(many, {"op": "hello"})
        assert recv_frame(many)["ok"]
        socket.send_fds(many, [encode_frame({"op": "register"})], [memfd] * 4)
        assert refused(many)[0] == 400
        assert r.on_loop(lambda: (r.server.clients, r.server.waiting)) == (0, 0)
        for sock in (early, s, hoard, many):
            sock.close()
    os.close(memfd)


def test_the_socket_folder_must_be_ours_and_closed_to_others(tmp_path):
    registry = RegionRegistry(max_regions=1, max_bytes=1, adopt=SharedBuffer.adopt)
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o777)

    async def start(path):
        server = RegionServer(str(path), registry, authorize=None, max_clients=1, instance="x")
        server.start()
        mode = os.stat(path).st_mode & 0o777
        server.close()
        return mode, os.path.exists(path)

    with pytest.raises(PermissionError, match="others cannot"):
        asyncio.run(start(open_folder / "regions.sock"))
    made = tmp_path / "made" / "here"
    assert asyncio.run(start(made / "regions.sock")) == (0o600, False)
    assert os.stat(made).st_mode & 0o777 == 0o700


def test_a_frame_sent_whole_is_read_in_one_turn_and_never_past_its_end(tmp_path):
    """Its length and its body in one callback of the loop (one turn, not one per read);
    two frames sent at once are still answered one after the other, in order."""
    with running(tmp_path) as r:
        calls: list[int] = []

        def install() -> None:
            real = r.server._readable

            def counted(client):
                calls.append(client.id)
                real(client)

            r.server._readable = counted  # type: ignore[method-assign]

        r.on_loop(install)
        s = r.connect()
        s.sendall(encode_frame({"op": "hello"}))
        assert recv_frame(s)["ok"]
        assert len(calls) == 1
        s.sendall(encode_frame({"op": "unregister", "region": "a"})[:6])  # cut in its body
        # until the server has read the first part (and waits for more)
        wait_for(lambda: len(calls) >= 2, 5, "the server never read the frame's first part", 0.01)
        s.sendall(encode_frame({"op": "unregister", "region": "a"})[6:])
        assert recv_frame(s)["status"] == 422
        assert len(calls) == 3
        s.sendall(encode_frame({"op": "unregister", "region": "b"}) + encode_frame({"op": "hello"}))
        first, second = recv_frame(s), recv_frame(s)
        assert "'b'" in first["error"] and second["ok"]
        s.close()
