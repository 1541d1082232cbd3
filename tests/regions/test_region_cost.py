"""Regions cost their owner, in this process (no service): a memfd's holes found at
registration and when a request names it, pages past its end no part of it (and none can come
there once it is registered), write seals added after registering found when a request names
it, byte budgets per owner and over all owners charged by whole pages, one user's connections
sharing one budget on the socket, and a region's memory given up the moment the region ends and
no request in flight holds it (`SharedBuffer.release`)."""

from __future__ import annotations

import errno
import fcntl
import gc
import os

import pytest
import torch

from tests.memfds import sealed
from tests.processes import eventually
from tests.regions.region_sockets import (
    allocate_past_end,
    held_bytes,
    inside_bytes,
    mapping,
    maps_memfd,
    punch_hole,
    running,
)
from zen_mla import InvalidInputError, ServiceUnavailableError
from zen_mla.pool import SharedBuffer
from zen_mla.regions import memfd
from zen_mla.regions.memfd import check_populated, create_sealed_memfd, unpopulated
from zen_mla.regions.protocol import recv_frame, send_frame
from zen_mla.regions.registry import RegionRegistry
from zen_mla.wire.regions_json import TensorPlace

KiB = 1 << 10


def _registry(**limits: int) -> RegionRegistry:
    limits = {"max_regions": 8, "max_bytes": 1 << 30} | limits
    return RegionRegistry(adopt=SharedBuffer.adopt, **limits)


def _sparse(nbytes: int) -> int:
    """A memfd of `nbytes` sealed against shrinking only, with no page behind it."""
    return sealed(fcntl.F_SEAL_SHRINK, nbytes)


# -- holes --------------------------------------------------------------------------------------


def test_a_memfd_made_here_is_populated_and_holes_are_counted():
    fd = create_sealed_memfd(5000)  # two pages, the second in part
    try:
        assert held_bytes(fd) == 8192 and unpopulated(fd, 5000) == 0
        check_populated(fd, 5000)
        punch_hole(fd, 4096, 4096)
        assert unpopulated(fd, 5000) == 904  # its bytes that the missing page held
        with pytest.raises(InvalidInputError, match="904 of 5000 bytes are holes"):
            check_populated(fd, 5000)
        os.posix_fallocate(fd, 0, 5000)
        check_populated(fd, 5000)
    finally:
        os.close(fd)


def _growing(nbytes: int) -> int:
    """A memfd of `nbytes`, populated, sealed against shrinking only (as a client of another
    language may hand one over)."""
    fd = sealed(fcntl.F_SEAL_SHRINK, nbytes)
    os.posix_fallocate(fd, 0, nbytes)
    return fd


@pytest.mark.parametrize("inside", ["holes", "populated"])
def test_pages_held_past_the_end_are_no_part_of_the_region(inside):
    """A memfd holding as many bytes as its size, all of them past its end (fallocate with
    KEEP_SIZE), was taken as populated: a worker then faulted the whole region in, the
    service's memory, and the client gave its own pages back. Pages past the end are refused,
    holes inside or not (they could stand for holes punched later)."""
    registry = _registry()
    fd = _sparse(64 * KiB) if inside == "holes" else _growing(64 * KiB)
    probe = os.dup(fd)
    try:
        allocate_past_end(probe, 64 * KiB)
        with pytest.raises(InvalidInputError, match="65536 bytes of pages past its 65536 bytes"):
            registry.register(fd, {})
        assert len(registry) == 0 and registry.total_bytes == 0
        assert inside_bytes(probe) == (0 if inside == "holes" else 64 * KiB)  # none faulted in
    finally:
        os.close(probe)


def test_a_registered_memfd_can_hold_no_page_past_its_end():
    """Sealed against growing as it is taken (where its client has not): pages fallocated past
    its end after registering would hide as many holes punched inside from the check of each
    request (`st_blocks`)."""
    registry = _registry()
    fd = _growing(64 * KiB)
    probe = os.dup(fd)
    try:
        region = registry.register(fd, {})
        assert fcntl.fcntl(probe, fcntl.F_GET_SEALS) & fcntl.F_SEAL_GROW
        with pytest.raises(OSError) as refused:
            allocate_past_end(probe, 64 * KiB)
        assert refused.value.errno == errno.EPERM
        punch_hole(probe, 0, 4 * KiB)
        with pytest.raises(InvalidInputError, match="4096 of its region's 65536 bytes are holes"):
            registry.tensor("q", TensorPlace(region.handle, 0, "F32", (16,)), ("F32",))
    finally:
        os.close(probe)


def test_a_memfd_whose_seals_are_sealed_must_be_sealed_against_growing():
    registry = _registry()
    fd = sealed(fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    os.posix_fallocate(fd, 0, 4 * KiB)
    with pytest.raises(InvalidInputError, match="F_SEAL_GROW"):
        registry.register(fd, {})
    fd = sealed(fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    os.posix_fallocate(fd, 0, 4 * KiB)
    registry.register(fd, {})
    assert len(registry) == 1


def test_without_cachestat_only_more_pages_than_the_region_holds_are_told_past_its_end(
    monkeypatch,
):
    """A kernel before 6.5 (no `cachestat`; a call number it does not know answers ENOSYS the
    same way) tells pages past the end only from `st_blocks` beyond the region's pages."""
    monkeypatch.setattr(memfd, "_SYS_CACHESTAT", 100_000)
    fd = _growing(64 * KiB)
    try:
        allocate_past_end(fd, 8 * KiB)
        with pytest.raises(InvalidInputError, match="8192 bytes of pages past"):
            check_populated(fd, 64 * KiB)
        punch_hole(fd, 0, 8 * KiB)
        check_populated(fd, 64 * KiB)  # as many holes inside as pages past: not told apart
    finally:
        os.close(fd)


def test_a_sparse_memfd_is_refused_before_it_is_mapped():
    registry = _registry()
    fd = _sparse(1 << 20)
    probe = os.dup(fd)
    held: dict = {}
    try:
        with pytest.raises(InvalidInputError, match="fallocate it, or write it"):
            registry.register(fd, held)
        assert not held and len(registry) == 0 and registry.total_bytes == 0
        assert not maps_memfd(os.getpid(), probe)  # by inode: other tests map regions too
        assert held_bytes(probe) == 0
    finally:
        os.close(probe)


def test_holes_punched_after_registering_refuse_the_tensors_in_that_region():
    registry = _registry()
    fd = create_sealed_memfd(64 * KiB)
    probe = os.dup(fd)
    try:
        region = registry.register(fd, {})
        q = TensorPlace(region.handle, 0, "F32", (16,))
        registry.tensor("q", q, ("F32",))
        registry.check_usable({"q": q})
        punch_hole(probe, 32 * KiB, 4 * KiB)
        with pytest.raises(InvalidInputError, match=r"q: .*4096 of its region's 65536 bytes are"):
            registry.tensor("q", q, ("F32",))
        with pytest.raises(InvalidInputError, match="punch no holes"):
            registry.check_usable({"q": q})
        assert held_bytes(probe) == 60 * KiB  # nothing faulted back in by the checks
        os.posix_fallocate(probe, 0, 64 * KiB)
        registry.check_usable({"q": q})
    finally:
        os.close(probe)


def test_a_write_seal_added_after_registering_refuses_the_tensors_in_that_region():
    """F_SEAL_FUTURE_WRITE, which a client may add at any time, makes a worker's writable
    mapping of the memfd fail (EPERM): a request naming the region is refused before one
    tries, naming the tensor, its region and the seal."""
    registry = _registry()
    fd = create_sealed_memfd(64 * KiB)
    probe = os.dup(fd)
    try:
        region = registry.register(fd, {})
        q = TensorPlace(region.handle, 0, "F32", (16,))
        fcntl.fcntl(probe, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE)
        says = rf"q\.region: .*got region '{region.handle}' sealed against writing"
        with pytest.raises(InvalidInputError, match=says):
            registry.tensor("q", q, ("F32",))
        with pytest.raises(InvalidInputError, match=says):
            registry.check_usable({"q": q})
    finally:
        os.close(probe)


_F_SEAL_FUTURE_WRITE = 0x0010  # <linux/fcntl.h>; Python's fcntl names it from 3.12


# -- budgets ------------------------------------------------------------------------------------


def test_bytes_are_counted_per_owner_over_all_its_connections():
    registry = _registry(max_bytes=3 * 64 * KiB)
    first: dict = {}
    second: dict = {}
    registry.register(create_sealed_memfd(64 * KiB), first, owner=1000)
    registry.register(create_sealed_memfd(64 * KiB), second, owner=1000)
    registry.register(create_sealed_memfd(128 * KiB), {}, owner=1001)  # another user's own
    with pytest.raises(InvalidInputError, match="over all its connections"):
        registry.register(create_sealed_memfd(128 * KiB), second, owner=1000)
    assert registry.bytes_of(1000) == 128 * KiB and registry.total_bytes == 256 * KiB
    registry.drop(first)
    registry.register(create_sealed_memfd(128 * KiB), second, owner=1000)
    assert registry.bytes_of(1000) == 192 * KiB
    registry.drop(second)
    assert registry.bytes_of(1000) == 0 and registry.total_bytes == 128 * KiB


def test_all_owners_together_stay_under_the_total():
    registry = _registry(max_total_bytes=128 * KiB)
    held: dict = {}
    a = registry.register(create_sealed_memfd(64 * KiB), held, owner=1)
    registry.register(create_sealed_memfd(64 * KiB), {}, owner=2)
    with pytest.raises(ServiceUnavailableError, match="at most 131072"):
        registry.register(create_sealed_memfd(4 * KiB), {}, owner=3)
    registry.unregister(a.handle, held)
    registry.register(create_sealed_memfd(4 * KiB), {}, owner=3)
    assert registry.total_bytes == 68 * KiB


def test_a_region_is_charged_every_page_a_worker_may_fault_in():
    """A worker's mapping faults whole pages in: a region of 5000 bytes may cost two."""
    registry = _registry(max_bytes=12 * KiB)
    held: dict = {}
    region = registry.register(create_sealed_memfd(5000), held, owner=1)
    assert region.nbytes == 5000 and registry.bytes_of(1) == registry.total_bytes == 8 * KiB
    registry.register(create_sealed_memfd(1), held, owner=1)
    with pytest.raises(InvalidInputError, match="got 16384 bytes"):
        registry.register(create_sealed_memfd(1), held, owner=1)
    registry.drop(held)
    assert registry.bytes_of(1) == registry.total_bytes == 0


def test_the_total_defaults_to_the_hosts_memory():
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    assert _registry().max_total_bytes == pages * size


def test_one_users_connections_share_its_budget_on_the_socket(tmp_path):
    with running(tmp_path) as r:
        r.server.registry.max_bytes = 96 * KiB
        a, b = r.connect(), r.connect()
        fds = [create_sealed_memfd(64 * KiB) for _ in range(2)]
        try:
            for s in (a, b):
                send_frame(s, {"op": "hello"})
                assert recv_frame(s)["ok"]
            send_frame(a, {"op": "register"}, fds[0])
            assert recv_frame(a)["ok"]
            send_frame(b, {"op": "register"}, fds[1])
            refusal = recv_frame(b)
            assert refusal["status"] == 422 and "over all its connections" in refusal["error"]
            assert r.on_loop(lambda: r.server.registry.bytes_of(os.getuid())) == 64 * KiB
            a.close()
            assert eventually(lambda: r.on_loop(lambda: r.server.registry.total_bytes) == 0)
            send_frame(b, {"op": "register"}, fds[1])
            assert recv_frame(b)["ok"]
        finally:
            b.close()
            for fd in fds:
                os.close(fd)


# -- release ------------------------------------------------------------------------------------


def test_a_region_that_ends_is_unmapped_at_once_whoever_holds_a_view():
    """A view kept past the region's end (a job's result in a reference cycle) kept the client's
    memfd mapped, and its descriptor open, until the next garbage collection."""
    registry = _registry()
    fd = create_sealed_memfd(64 * KiB, "zen-mla-ends")
    probe = os.dup(fd)
    held: dict = {}
    try:
        region = registry.register(fd, held)
        place = TensorPlace(region.handle, 0, "F32", (4,))
        view = registry.tensor("q", place, ("F32",))
        view.copy_(torch.arange(4.0))
        cycle: list = [view]
        cycle.append(cycle)
        gc.disable()
        try:
            del view, region
            registry.drop(held)
            assert not mapping(os.getpid(), "zen-mla-ends")
            assert torch.equal(cycle[0], torch.zeros(4))  # reads zeros, faults nothing
            del cycle
        finally:
            gc.enable()
        kept = bytearray(os.pread(probe, 16, 0))  # the client's memory is untouched
        assert torch.equal(torch.frombuffer(kept, dtype=torch.float32), torch.arange(4.0))
    finally:
        os.close(probe)


def test_a_request_in_flight_keeps_an_ended_region_mapped_until_it_is_done():
    """A region that ends under a request (its client unregistered it, or left) stays mapped,
    and the pool is not told, until that request lets go of the buffer; then both at once."""
    freed: list[int] = []
    registry = RegionRegistry(
        max_regions=8,
        max_bytes=1 << 30,
        adopt=lambda fd, nbytes: SharedBuffer.adopt(fd, nbytes, freed.append),
    )
    held: dict = {}
    region = registry.register(create_sealed_memfd(64 * KiB, "zen-mla-in-flight"), held, owner=1)
    in_flight = [region.buffer]  # a task holds its buffers until it is done
    del region
    registry.drop(held)
    assert mapping(os.getpid(), "zen-mla-in-flight") and not freed
    assert registry.bytes_of(1) == 0  # out of the budget at once all the same
    in_flight.clear()
    assert not mapping(os.getpid(), "zen-mla-in-flight") and len(freed) == 1
