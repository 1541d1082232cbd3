"""A hostile region client beside a legitimate one, on a real server (docs/protocol.md, "Limits",
and "Same-host shared memory"): memory it did not populate, dims past every wire's cap, a region
sealed against writing after registering. Each attack's requests are refused with a 4xx naming what
was wrong, the service faults no page into the attacker's memfds, logs no traceback and restarts no
worker, and the legitimate client (`PrefillClient`, regions required) gets the library's answers
throughout."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

import zen_mla
from tests.memfds import sealed
from tests.regions.region_sockets import (
    allocate_past_end,
    inside_bytes,
    punch_hole,
    service_pids,
)
from tests.service.region_clients import (
    REGION_JSON,
    SharedMemfd,
    lay_out,
    region_socket,
)
from tests.service.servers import Server, serve, server_fixture
from zen_mla import InvalidInputError
from zen_mla.client import PrefillClient
from zen_mla.regions.connection import RegionConnection
from zen_mla.regions.protocol import call_fields
from zen_mla.wire import regions_json as rr

MiB = 1 << 20
KiB = 1 << 10
_F_SEAL_FUTURE_WRITE = 0x0010  # <linux/fcntl.h>; Python's fcntl names it from 3.12
_names = itertools.count()


@server_fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("region_hostile"), workers=1) as s:
        yield s


class _Legitimate:
    """The legitimate client: a PrefillClient that must use regions, each answer checked
    against the library in this process."""

    def __init__(self, server: Server) -> None:
        self.client = PrefillClient(server.url, shared_memory=True)
        self.rounds = 0

    def check(self) -> None:
        g = torch.Generator().manual_seed(self.rounds)
        q = torch.randn(96, 16, 192, generator=g).bfloat16()
        k = torch.randn(96, 16, 192, generator=g).bfloat16()
        v = torch.randn(96, 16, 128, generator=g).bfloat16()
        cu = torch.tensor([0, 40, 96], dtype=torch.int32)
        assert torch.equal(self.client.prefill(q, k, v, cu), zen_mla.ragged_attention(q, k, v, cu))
        self.rounds += 1

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def legitimate(hostile: Server) -> Iterator[_Legitimate]:
    legit = _Legitimate(hostile)
    try:
        legit.check()
        yield legit
        legit.check()
    finally:
        legit.close()


@pytest.fixture
def quiet(hostile: Server) -> Iterator[None]:
    """The test adds no traceback and no 500 to the server's log, and no worker is replaced."""
    start, workers = len(hostile.logs()), service_pids(hostile.process.pid)
    yield
    written = hostile.logs()[start:]
    assert "Traceback" not in written and '"status": 500' not in written, written[-3000:]
    assert service_pids(hostile.process.pid) == workers


def _memfd(nbytes: int) -> int:
    """A memfd sealed against shrinking only, no page behind it, of a name of its own."""
    return sealed(fcntl.F_SEAL_SHRINK, nbytes, name=f"zen-mla-hostile-{os.getpid()}-{next(_names)}")


def _call(client: RegionConnection, places: dict, meta: dict | None = None) -> dict:
    reply = client.try_call(call_fields({"body": rr.encode(places, meta).decode()}), 60)
    assert reply is not None
    return reply


@dataclass
class _Attacker:
    """The hostile client's connection, a populated region of its own on it (`fd`, `region`)
    and the places of a request laid out there."""

    server: Server
    client: RegionConnection
    fd: int
    region: SharedMemfd
    places: dict

    def refused(self, route: str, body: str) -> dict:
        """The problem `body` (a regions JSON request) is refused with, over `route` (the
        socket's call, or HTTP): a 422's."""
        if route == "socket":
            reply = self.client.try_call(call_fields({"body": body}), 60)
            assert reply is not None and reply.get("status") == 422, reply
            return reply
        with self.server.client() as c:
            r = c.post("/prefill", content=body, headers=REGION_JSON)
        assert r.status_code == 422, r.text
        return dict(r.json())


@contextlib.contextmanager
def _attacking(server: Server, nbytes: int, tokens: int) -> Iterator[_Attacker]:
    fd = _memfd(nbytes)
    os.posix_fallocate(fd, 0, nbytes)
    client = RegionConnection(region_socket(server), None)
    try:
        region = SharedMemfd(fd, nbytes)
        region.handle = client.register(fd)
        places, _ = lay_out(region, tokens, lse=False)
        yield _Attacker(server, client, fd, region, places)
    finally:
        client.close()
        os.close(fd)


# -- A: memory the client did not populate ---------------------------------------------------------

REGION = 32 * MiB
WRITTEN = 64 * KiB  # the attacker writes q, its offsets and nothing else below this; k, v above


def _sparse_call(region: SharedMemfd, nbytes: int) -> dict:
    """A call whose q (one token) the client writes and whose k and v fill the rest of the
    region unwritten: a worker reading them faults in every page they span."""
    h, dqk, dv = 2, 64, 32
    tokens = (nbytes - WRITTEN) // (h * (dqk + dv) * 4)
    q = region.tensor(0, (1, h, dqk), torch.float32)
    q.copy_(torch.randn(q.shape))
    cu, kv_cu = region.tensor(4096, (2,), torch.int32), region.tensor(4160, (2,), torch.int32)
    cu.copy_(torch.tensor([0, 1]))
    kv_cu.copy_(torch.tensor([0, tokens]))
    out = region.tensor(8192, (1, h, dv), torch.float32)
    k = region.tensor(WRITTEN, (tokens, h, dqk), torch.float32)
    v = region.tensor(WRITTEN + k.nbytes, (tokens, h, dv), torch.float32)
    return {
        "q": region.place(0, q),
        "k": region.place(WRITTEN, k),
        "v": region.place(WRITTEN + k.nbytes, v),
        "q_cu_seq_lens": region.place(4096, cu),
        "kv_cu_seq_lens": region.place(4160, kv_cu),
        "out": region.place(8192, out),
    }


def test_pages_past_the_end_buy_the_attacker_no_memory_of_the_services(hostile, legitimate, quiet):
    """Three memfds with no page inside and as many bytes fallocated past the end (KEEP_SIZE)
    were registered (`st_blocks` counted those), and a call naming k and v over each made the
    worker fault the whole region in: memory the service allocated and held (762 MiB for three
    of 256 MiB), while the client gave its own pages back. No page may be faulted into memory
    the client did not populate."""
    attacker = RegionConnection(region_socket(hostile), None)
    fds = [_memfd(REGION) for _ in range(3)]
    try:
        for fd in fds:
            allocate_past_end(fd, REGION)
            try:
                handle = attacker.register(fd)
            except InvalidInputError as exc:
                assert "past its" in str(exc), exc
            else:
                region = SharedMemfd(fd, REGION)
                region.handle = handle
                _call(attacker, _sparse_call(region, REGION), {"causal": "false"})
                punch_hole(fd, REGION, REGION)  # the client's own pages, given back
            legitimate.check()
        faulted = [inside_bytes(fd) for fd in fds]
        assert all(n <= WRITTEN for n in faulted), f"the service faulted in {faulted} bytes"
    finally:
        attacker.close()
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("route", ["socket", "http"])
def test_holes_hidden_by_pages_past_the_end_refuse_the_call(hostile, legitimate, quiet, route):
    """A populated region, called once; then pages fallocated past its end and as many punched
    out of k: `st_blocks` saw the region whole, and the next call made a worker fault k's pages
    back in, the service's memory. The call is refused naming a tensor in the region, with
    nothing faulted in."""
    with _attacking(hostile, 8 * MiB, 4096) as attacker:
        fd, places = attacker.fd, attacker.places
        assert _call(attacker.client, places)["ok"]
        k = places["k"]
        with contextlib.suppress(PermissionError):  # sealed against growing as it was taken
            allocate_past_end(fd, k.nbytes)
        punch_hole(fd, k.offset, k.nbytes)
        before = inside_bytes(fd)
        problem = attacker.refused(route, rr.encode(places).decode())
        assert "holes" in problem["detail"] and problem["tensor"] in places, problem
        assert inside_bytes(fd) == before == 8 * MiB - k.nbytes
        legitimate.check()


# -- B: dims past the cap --------------------------------------------------------------------------

#: shapes of q (or k) past the cap, each with the field its refusal names
PAST_THE_CAP = [
    ("q", [1 << 64, 16, 192]),
    ("q", [0, 1 << 64, 192]),
    ("k", [1 << 47, 1 << 47, 0]),
    ("k", [4, 16, 1 << 48]),
]


def test_dims_past_the_cap_are_422s_naming_the_tensor_and_field(hostile, legitimate, quiet):
    """A dim of 2^64 beside a 0 (no bytes to check a range by) reached torch's view(): a 500
    InternalError with a traceback in the log, one per request. Sixty requests, over HTTP and
    over the socket, each a 422 naming `<tensor>.shape`."""
    with _attacking(hostile, MiB, 64) as attacker:
        good = json.loads(rr.encode(attacker.places))
        for i in range(60):
            name, shape = PAST_THE_CAP[i % len(PAST_THE_CAP)]
            body = json.dumps({**good, name: {**good[name], "shape": shape}})
            problem = attacker.refused("socket" if i % 2 else "http", body)
            assert problem["tensor"] == f"{name}.shape" and "2^48" in problem["detail"], problem
            if i % 10 == 9:
                legitimate.check()
        assert _call(attacker.client, attacker.places)["ok"]  # the region and connection go on


# -- C: a write seal added after registering -------------------------------------------------------


@pytest.mark.parametrize("route", ["socket", "http"])
def test_a_region_sealed_against_writing_after_registering_is_a_422_naming_it(
    hostile, legitimate, quiet, route
):
    """F_SEAL_FUTURE_WRITE added after registering made the worker's mmap of the region fail
    (EPERM): a 500 KernelError. The call is refused naming the tensor's region, and the
    connection, its other regions and the worker go on."""
    with _attacking(hostile, MiB, 64) as attacker:
        fcntl.fcntl(attacker.fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE)
        for _ in range(3):
            problem = attacker.refused(route, rr.encode(attacker.places).decode())
            assert problem["tensor"] == "q.region", problem
            detail = problem["detail"]
            assert attacker.region.handle in detail and "sealed against writing" in detail
            legitimate.check()
        fine = _memfd(MiB)
        os.posix_fallocate(fine, 0, MiB)
        other = SharedMemfd(fine, MiB)
        other.handle = attacker.client.register(fine)
        os.close(fine)
        places, (q, k, v, cu, out) = lay_out(other, 64, lse=False)
        assert _call(attacker.client, places)["ok"]
        assert torch.allclose(out, zen_mla.ragged_attention(q, k, v, cu), atol=1e-5, rtol=1e-4)
