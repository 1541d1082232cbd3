"""Same-host regions on real servers: memfds handed over the region socket, requests that name
places instead of carrying bytes, both clients, and every bad request a 4xx that leaves the
service healthy."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
import torch

import zen_mla
from tests.batches import BATCH_SPECS, make_batch
from tests.memfds import UNMAPPABLE
from tests.processes import open_fds, wait_for
from tests.reference import assert_close_to_reference
from tests.service.region_clients import SharedMemfd, lay_out, post_places, region_socket
from tests.service.servers import ROOT, serve
from zen_mla.client import AsyncPrefillClient, PrefillClient
from zen_mla.regions.connection import ClientRegion, RegionConnection
from zen_mla.regions.memfd import create_sealed_memfd
from zen_mla.regions.protocol import recv_frame, send_frame
from zen_mla.wire import regions_json as rr

pytestmark = pytest.mark.slow
REGION_JSON = {"Content-Type": rr.MEDIA_TYPE}


def _offer(server) -> dict:
    region_socket(server)
    return server.health()["shared_memory"]


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("spec", BATCH_SPECS.values(), ids=BATCH_SPECS.keys())
def test_round_trip_through_regions(server, spec, return_lse):
    q, k, v, q_cu, kv_cu = make_batch(spec, (3, 192, 128), torch.bfloat16)
    causal = spec.kv_lens is None
    with PrefillClient(server.url, shared_memory=True) as client:
        got = client.prefill(q, k, v, q_cu, kv_cu, causal=causal, return_lse=return_lse)
        assert client.regions(0) is not None
    out, lse = got if return_lse else (got, None)
    assert_close_to_reference(q, k, v, q_cu, kv_cu, causal, out, lse)


def test_a_large_answer_is_copied_into_answer_memory_reused_once_dropped(server):
    """out of 4 MiB (1024 x 16 x 128 bf16), copied out of the scratch region: into memory the
    client keeps, handed out again only once the result holding it is gone."""
    q = torch.randn(1024, 16, 192, dtype=torch.bfloat16)
    k, v = torch.randn(4, 16, 192, dtype=torch.bfloat16), torch.randn(4, 16, 128).bfloat16()
    args = (q, k, v, torch.tensor([0, 1024]).int(), torch.tensor([0, 4]).int())
    want = zen_mla.ragged_attention(*args, causal=False)
    with PrefillClient(server.url, shared_memory=True) as client:
        first = client.prefill(*args, causal=False)
        second = client.prefill(*args, causal=False)
        assert torch.equal(first, want) and torch.equal(second, want)
        address = first.untyped_storage().data_ptr()
        assert second.untyped_storage().data_ptr() != address
        del first
        gc.collect()
        third = client.prefill(*args, causal=False)
        assert torch.equal(third, want) and torch.equal(second, want)
        assert third.untyped_storage().data_ptr() == address


def test_async_client_and_tensors_built_in_a_region(server):
    q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS["prefix_cached"], (2, 192, 128), torch.bfloat16)

    async def main():
        async with AsyncPrefillClient(server.url, shared_memory=True) as client:
            qe = await client.empty(q.shape, q.dtype)
            qe.copy_(q)
            both = await asyncio.gather(
                client.prefill(qe, k, v, q_cu, kv_cu, return_lse=True),
                client.prefill(q, k, v, q_cu, kv_cu, return_lse=True),
            )
            return both, (await client.regions()).where(qe)

    (first, second), place = asyncio.run(main())
    assert place is not None and place.offset == 0  # named where it lies, not copied
    for out, lse in (first, second):
        assert_close_to_reference(q, k, v, q_cu, kv_cu, True, out, lse)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_automatic_choice_and_refusal(tmp_path, server):
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 64), torch.float32)
    with PrefillClient(server.url) as client:  # None: used where offered and reachable
        client.prefill(q, k, v, q_cu)
        assert client.regions(0) is not None
    with serve(tmp_path, workers=1, shared_memory=False) as plain:
        assert plain.health()["shared_memory"] is None
        with PrefillClient(plain.url) as client:
            assert_close_to_reference(q, k, v, q_cu, None, True, client.prefill(q, k, v, q_cu))
            assert client.regions(0) is None
        with (
            PrefillClient(plain.url, shared_memory=True) as client,
            pytest.raises(zen_mla.SharedMemoryUnavailableError, match="offers no"),
        ):
            client.prefill(q, k, v, q_cu)
        body = rr.encode({"q": rr.TensorPlace("h", 0, "F32", (1, 1, 1))})
        with plain.client() as c:
            r = c.post("/prefill", content=body, headers=REGION_JSON)
        assert r.status_code == 415


def _region(client: RegionConnection, nbytes: int) -> ClientRegion:
    return ClientRegion(client, nbytes)


def test_a_request_by_hand_writes_out_in_place_and_says_where(server):
    offer = _offer(server)
    client = RegionConnection(offer["socket"], None)
    try:
        assert client.hello["instance"] == offer["instance"]
        region = _region(client, 1 << 20)
        places, (q, k, v, cu, out) = lay_out(region, 100, lse=False)
        r = post_places(server, places, {"request_id": "by-hand"})
        assert r.status_code == 200, r.text
        answer = rr.decode(r.content, frozenset({"out", "lse"}))
        assert answer.places == {"out": places["out"]}
        assert answer.metadata["request_id"] == "by-hand" and answer.metadata["kernel"]
        assert "server-timing" in r.headers
        assert_close_to_reference(q, k, v, cu, None, True, out)
    finally:
        client.close()


def _as(p: rr.TensorPlace, dtype: str, shape: tuple[int, ...]) -> rr.TensorPlace:
    return rr.TensorPlace(p.region, p.offset, dtype, shape)


BAD_PLACES = {
    "forged_handle": lambda p: p | {"q": rr.TensorPlace("A" * 24, 0, *_dt_shape(p["q"]))},
    "past_the_end": lambda p: p | {"k": _moved(p["k"], (1 << 20) - 64)},
    "misaligned": lambda p: p | {"k": _moved(p["k"], p["k"].offset + 2)},
    "out_over_q": lambda p: p | {"out": _moved(p["out"], p["q"].offset)},
    "out_wrong_shape": lambda p: p | {"out": _as(p["out"], "F32", (1, 2, 32))},
    "out_wrong_dtype": lambda p: p | {"out": _as(p["out"], "BF16", p["out"].shape)},
    "no_out": lambda p: {n: x for n, x in p.items() if n != "out"},
    "lse_without_return_lse": lambda p: p | {"lse": _moved(p["out"], p["out"].offset + 4096)},
    "cu_as_floats": lambda p: p | {"q_cu_seq_lens": _as(p["q_cu_seq_lens"], "F32", (2,))},
    "q_too_long_for_cu": lambda p: p | {"q": _as(p["q"], "F32", (101, 2, 64))},
}


def _dt_shape(p: rr.TensorPlace):
    return p.dtype, p.shape


def _moved(p: rr.TensorPlace, offset: int) -> rr.TensorPlace:
    return rr.TensorPlace(p.region, offset, p.dtype, p.shape)


@pytest.mark.parametrize("bad", BAD_PLACES.values(), ids=BAD_PLACES.keys())
def test_bad_places_are_4xx_naming_what_is_wrong(server, bad):
    client = RegionConnection(_offer(server)["socket"], None)
    try:
        places, _ = lay_out(_region(client, 1 << 20), 100, lse=False)
        r = post_places(server, bad(places))
        assert r.status_code in (400, 422), r.text
        problem = r.json()
        assert problem["status"] == r.status_code and problem["detail"]
    finally:
        client.close()
    assert server.health()["status"] == "ok"


def test_a_region_unregistered_or_its_client_gone_is_no_longer_named(server):
    client = RegionConnection(_offer(server)["socket"], None)
    region = _region(client, 1 << 20)
    places, _ = lay_out(region, 50, lse=True)
    assert post_places(server, places, {"return_lse": "true"}).status_code == 200
    client.unregister(region.handle)
    r = post_places(server, places, {"return_lse": "true"})
    assert r.status_code == 422 and "registered region" in r.json()["detail"]
    other = RegionConnection(_offer(server)["socket"], None)
    region = _region(other, 1 << 20)
    places, _ = lay_out(region, 50, lse=False)
    other.close()  # the socket closes: its regions end
    wait_for(lambda: post_places(server, places).status_code == 422, 10, "the region still named")
    client.close()


def test_descriptors_that_are_not_sealed_memfds_are_refused(server, tmp_path):
    path = _offer(server)["socket"]
    unsealed = os.memfd_create("x", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 4096)
    plain = os.open(tmp_path / "file", os.O_CREAT | os.O_RDWR)
    r, w = os.pipe()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        send_frame(sock, {"op": "hello"})
        assert recv_frame(sock)["ok"]
        for fd, says in ((unsealed, "can shrink"), (plain, "memfd"), (r, "memfd")):
            send_frame(sock, {"op": "register"}, fd)
            reply = recv_frame(sock)
            assert not reply["ok"] and reply["status"] == 422 and says in reply["error"]
        send_frame(sock, {"op": "register"})  # no descriptor at all
        assert recv_frame(sock)["status"] == 422
        send_frame(sock, {"op": "unregister", "region": "nope"})
        assert recv_frame(sock)["status"] == 422
        sealed = create_sealed_memfd(1 << 16)
        send_frame(sock, {"op": "register"}, sealed)
        first = recv_frame(sock)
        send_frame(sock, {"op": "register"}, sealed)  # the same memfd again
        assert first["ok"] and not recv_frame(sock)["ok"]
        sock.sendall(b"\xff\xff\xff\xff")  # a frame announcing 4 GiB: refused, closed
        assert recv_frame(sock)["status"] == 413
        assert sock.recv(1) == b""
    for fd in (unsealed, plain, r, w, sealed):
        os.close(fd)
    assert server.health()["status"] == "ok"


@pytest.mark.parametrize("case", UNMAPPABLE.values(), ids=UNMAPPABLE.keys())
def test_a_memfd_that_cannot_be_mapped_is_a_4xx_and_the_connection_stays(server, case):
    make, says = case
    client = RegionConnection(_offer(server)["socket"], None)
    try:
        region = _region(client, 1 << 20)
        fd = make()
        try:
            with pytest.raises(zen_mla.InvalidInputError, match=says):
                client.register(fd)
        finally:
            os.close(fd)
        places, (q, k, v, cu, out) = lay_out(region, 50, lse=False)  # registered before: kept
        assert post_places(server, places).status_code == 200
        assert_close_to_reference(q, k, v, cu, None, True, out)
    finally:
        client.close()


def test_out_over_q_through_another_handle_of_the_same_memfd_is_refused(server):
    path = _offer(server)["socket"]
    first, second = RegionConnection(path, None), RegionConnection(path, None)
    fd = create_sealed_memfd(1 << 20)
    try:
        memfd = SharedMemfd(fd, 1 << 20)
        memfd.handle = first.register(fd)
        other = second.register(fd)  # the same memory, another connection
    finally:
        os.close(fd)
    try:
        places, (q, *_rest) = lay_out(memfd, 100, lse=False)
        before = q.clone()
        over_q = places | {"out": rr.TensorPlace(other, 0, "F32", places["out"].shape)}
        r = post_places(server, over_q)
        assert r.status_code == 422, r.text
        assert r.json()["detail"].startswith("out: ") and "q: [0," in r.json()["detail"]
        assert torch.equal(q, before)
        apart = places | {"out": rr.TensorPlace(other, *_at(places["out"]))}
        assert post_places(server, apart).status_code == 200  # two handles, no overlap: fine
    finally:
        first.close()
        second.close()


def _at(p: rr.TensorPlace):
    return p.offset, p.dtype, p.shape


def test_the_token_guards_the_region_socket(tmp_path):
    with serve(tmp_path, workers=1, api_token="s3cret") as guarded:
        path = guarded.health()["shared_memory"]["socket"]
        with pytest.raises(zen_mla.SharedMemoryUnavailableError, match="token"):
            RegionConnection(path, "wrong")
        client = RegionConnection(path, "s3cret")
        client.close()
        q, k, v, q_cu, _ = make_batch(BATCH_SPECS["single"], (2, 64, 64), torch.float32)
        with PrefillClient(guarded.url, token="s3cret", shared_memory=True) as c:
            assert_close_to_reference(q, k, v, q_cu, None, True, c.prefill(q, k, v, q_cu))


KILLED_CLIENT = """
import sys, torch
sys.path.insert(0, {root!r})
from zen_mla.client import PrefillClient
c = PrefillClient({url!r}, shared_memory=True)
q = torch.randn(6000, 8, 64)
print("go", flush=True)
c.prefill(q, q, q, torch.tensor([0, 6000]), kernel="reference", causal=False)
"""


def _memfd_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("/memfd:zen-mla-region" in line for line in f)


def test_a_client_killed_mid_request_leaks_nothing(server):
    pid = server.process.pid
    before = (open_fds(pid), _memfd_maps(pid))
    for _ in range(3):
        code = KILLED_CLIENT.format(root=str(ROOT), url=server.url)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert child.stdout is not None and child.stdout.readline().strip() == b"go"
        child.stdout.close()
        wait_for(lambda: server.health()["queued"], 30, "the client's request never queued", 0.02)
        child.send_signal(signal.SIGKILL)
        child.wait()
    wait_for(
        lambda: not server.health()["queued"] and (open_fds(pid), _memfd_maps(pid)) <= before,
        60,
        lambda: str((before, open_fds(pid), _memfd_maps(pid))),
        0.1,
    )
    health = server.health()
    assert health["status"] == "ok", json.dumps(health)
    with httpx.Client() as c:
        assert c.get(server.url + "/health").status_code == 200
