"""Regions cost their owner (docs/protocol.md, "Limits"): one client's regions cannot grow the
service's memory beyond what that client populated. On a real server: a sparse memfd is refused
at registration, a region with holes punched after it is refused when a request names it (the
memfd holds no more memory after the call than before: no worker faulted a page into it), the
byte budget is one user's over all its connections, the mappings of a client that left go within
a second, and the ordinary client, which populates its regions, still gets right answers."""

from __future__ import annotations

import fcntl
import itertools
import os
from collections.abc import Iterator

import pytest
import torch

import zen_mla
from tests.memfds import sealed
from tests.processes import eventually
from tests.regions.region_sockets import held_bytes, holding, mapping, punch_hole, service_pids
from tests.service.region_clients import SharedMemfd, lay_out, post_places, region_socket
from tests.service.servers import Server, serve, server_fixture
from zen_mla import InvalidInputError
from zen_mla.client import PrefillClient
from zen_mla.regions.connection import RegionConnection
from zen_mla.regions.memfd import create_sealed_memfd
from zen_mla.regions.protocol import call_fields
from zen_mla.wire import regions_json as rr

MiB = 1 << 20
BUDGET = 384 * MiB  # one user's regions, over all its connections
TOKENS = 64  # lay_out's request: q, k, v of 64 tokens (32 KiB each), cu, out
_names = itertools.count()


@server_fixture(scope="module")
def costly(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("region_cost"), workers=1, shm_max_bytes=BUDGET) as s:
        yield s


def _memfd(nbytes: int) -> tuple[int, str]:
    """A populated, sealed memfd of a name no other test uses, and the name."""
    name = f"zen-mla-cost-{os.getpid()}-{next(_names)}"
    return create_sealed_memfd(nbytes, name), name


def _registered(client: RegionConnection, fd: int, nbytes: int) -> SharedMemfd:
    region = SharedMemfd(fd, nbytes)
    region.handle = client.register(fd)
    return region


def _socket_call(client: RegionConnection, places: dict) -> dict:
    reply = client.try_call(call_fields({"body": rr.encode(places).decode()}), 60)
    assert reply is not None
    return reply


def _registers(client: RegionConnection, fd: int) -> bool:
    """`fd` registered; False while the budget has no room (the server may not have read yet
    that another connection of ours closed)."""
    try:
        client.register(fd)
    except InvalidInputError as exc:
        assert "per client" in str(exc), exc
        return False
    return True


def test_a_sparse_memfd_is_refused_and_costs_the_service_nothing(costly):
    """A 256 MiB memfd never written (it costs its client nothing) is refused: a call naming it
    as k and v would make a worker fault it all in, charged to the service."""
    name = f"zen-mla-cost-sparse-{os.getpid()}"
    fd = sealed(fcntl.F_SEAL_SHRINK, 256 * MiB, name=name)
    client = RegionConnection(region_socket(costly), None)
    try:
        with pytest.raises(InvalidInputError, match="268435456 of 268435456 bytes are holes"):
            client.register(fd)
        assert not client.closed  # a refusal, and the connection goes on
        assert not any(mapping(pid, name) for pid in service_pids(costly.process.pid))
        assert held_bytes(fd) == 0
    finally:
        client.close()
        os.close(fd)


@pytest.mark.parametrize("route", ["socket", "http"])
def test_holes_punched_after_registering_refuse_the_call(costly, route):
    """Holes punched in k's bytes after registering: the call is refused naming a tensor in that
    region, and no page was faulted into the memfd (a worker reading k would have)."""
    fd, _ = _memfd(MiB)
    client = RegionConnection(region_socket(costly), None)
    try:
        region = _registered(client, fd, MiB)
        places, (q, k, v, cu, out) = lay_out(region, TOKENS, lse=False)
        punch_hole(fd, places["k"].offset, places["k"].nbytes)
        before = held_bytes(fd)
        if route == "socket":
            reply = _socket_call(client, places)
            assert reply["status"] == 422 and "bytes are holes" in reply["error"], reply
            assert reply["tensor"] in places, reply
        else:
            r = post_places(costly, places)
            assert r.status_code == 422 and "bytes are holes" in r.text, r.text
            assert r.json()["tensor"] in places, r.text
        assert held_bytes(fd) == before < MiB
        k.copy_(torch.randn(k.shape))  # populated again: answered
        assert _socket_call(client, places)["ok"]
        assert torch.allclose(out, zen_mla.ragged_attention(q, k, v, cu), atol=1e-5, rtol=1e-4)
    finally:
        client.close()
        os.close(fd)


def test_holes_punched_after_a_call_refuse_the_next_one(costly):
    """The same request again (its resolution kept by the service) after k's pages were given
    back: refused, with nothing faulted in."""
    fd, _ = _memfd(MiB)
    client = RegionConnection(region_socket(costly), None)
    try:
        region = _registered(client, fd, MiB)
        places, _ = lay_out(region, TOKENS, lse=False)
        assert _socket_call(client, places)["ok"]
        punch_hole(fd, places["k"].offset, places["k"].nbytes)
        before = held_bytes(fd)
        reply = _socket_call(client, places)
        assert reply["status"] == 422 and "bytes are holes" in reply["error"], reply
        assert held_bytes(fd) == before < MiB
    finally:
        client.close()
        os.close(fd)


def test_the_byte_budget_is_one_users_over_all_its_connections(costly):
    """Connections of one uid share one budget: three of 160 MiB, 480 MiB in all, do not fit
    under a 384 MiB one."""
    path = region_socket(costly)
    clients = [RegionConnection(path, None) for _ in range(3)]
    fds: list[int] = []
    try:
        for client in clients[:2]:
            fd, _ = _memfd(160 * MiB)
            fds.append(fd)
            client.register(fd)
        fd, _ = _memfd(160 * MiB)
        fds.append(fd)
        with pytest.raises(InvalidInputError, match=r"at most 402653184 bytes .* per client"):
            clients[2].register(fd)
        clients[0].close()  # its regions end, and their bytes leave the budget
        assert eventually(lambda: _registers(clients[2], fd), 2.0)
    finally:
        for client in clients:
            client.close()
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("route", ["socket", "http"])
def test_the_mappings_of_a_client_that_left_go_within_a_second(costly, route):
    """A client that called and left: the server kept its region mapped (and its memfd open)
    until a garbage collection, which a job's reference cycles waited for."""
    fd, name = _memfd(8 * MiB)
    client = RegionConnection(region_socket(costly), None)
    try:
        region = _registered(client, fd, 8 * MiB)
        places, _ = lay_out(region, TOKENS, lse=False)
        if route == "socket":
            assert _socket_call(client, places)["ok"]
        else:
            assert post_places(costly, places).status_code == 200
        pids = service_pids(costly.process.pid)
        assert any(mapping(pid, name) for pid in pids)
        client.close()
        assert eventually(lambda: not any(mapping(pid, name) for pid in pids), 1.0), [
            pid for pid in pids if mapping(pid, name)
        ]
        assert not holding(costly.process.pid, name)
    finally:
        client.close()
        os.close(fd)


def test_the_ordinary_client_populates_its_regions_and_gets_right_answers(costly):
    """PrefillClient's regions are populated before they are registered (a scratch region is
    larger than the request it first holds: its tail is populated too, not left as holes);
    answers match the library's."""
    q = torch.randn(100, 16, 192, dtype=torch.bfloat16)
    k, v = torch.randn(100, 16, 192).bfloat16(), torch.randn(100, 16, 128).bfloat16()
    cu = torch.tensor([0, 37, 100], dtype=torch.int32)
    want = zen_mla.ragged_attention(q, k, v, cu)
    with PrefillClient(costly.url, shared_memory=True) as client:
        assert torch.equal(client.prefill(q, k, v, cu), want)
        qe = client.empty(q.shape, q.dtype)
        qe.copy_(q)
        assert torch.equal(client.prefill(qe, k, v, cu), want)
        server = costly.process.pid
        regions = [
            f"/proc/{server}/fd/{fd}"
            for fd in os.listdir(f"/proc/{server}/fd")
            if _link(server, fd).startswith("/memfd:zen-mla-region ")
        ]
        assert len(regions) >= 2  # the scratch region and empty()'s
        for path in regions:
            st = os.stat(path)
            assert st.st_blocks * 512 >= st.st_size, (path, st)


def _link(pid: int, fd: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""
