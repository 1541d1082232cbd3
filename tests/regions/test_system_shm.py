"""The v2 system shared memory registry with real /dev/shm objects (no server): which keys it
opens, the ranges it holds, that a shrunk object is an error here, never a fault, and that
where tenants have tokens each client sees, names and counts its own regions only."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

from zen_mla import ForbiddenError, InvalidInputError, NotFoundError
from zen_mla.caller import Caller
from zen_mla.pool import SharedBuffer
from zen_mla.regions.system_shm import SHM_DIR, CallerShm, SystemShmRegistry

ALICE, BOB = Caller.tenant("alice"), Caller.tenant("bob")


def shm_object() -> Iterator[str]:
    """A fresh /dev/shm object of 64 KiB, removed afterwards; its key with the leading '/'."""
    name = f"zen_mla_test_{uuid.uuid4().hex[:12]}"
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.truncate(1 << 16)
    try:
        yield "/" + name
    finally:
        for p in (path, path + "_link"):
            if os.path.lexists(p):
                os.unlink(p)


@pytest.fixture
def key() -> Iterator[str]:
    yield from shm_object()


@pytest.fixture
def other_key() -> Iterator[str]:
    yield from shm_object()


def tenants(max_regions: int = 4, max_bytes: int = 1 << 30) -> SystemShmRegistry:
    """A registry whose clients are told apart (tenants with tokens of their own)."""
    return SystemShmRegistry(
        max_regions=max_regions, max_bytes=max_bytes, adopt=SharedBuffer.adopt, by_caller=True
    )


def registry(max_regions: int = 4, max_bytes: int = 1 << 30) -> CallerShm:
    """The regions of the one client there is where tenants have no tokens of their own."""
    whole = SystemShmRegistry(
        max_regions=max_regions, max_bytes=max_bytes, adopt=SharedBuffer.adopt, by_caller=False
    )
    return whole.of(Caller.of("127.0.0.1"))


@pytest.mark.parametrize(
    "bad",
    ["../etc/passwd", "/a/b", "", "/", ".", "/..", "a b", "/sem.mp-1", 7, None, "x" * 300],
    ids=repr,
)
def test_keys_name_one_object_directly_in_dev_shm(bad):
    with pytest.raises(InvalidInputError, match=r"^key: expected a POSIX shared memory name"):
        registry().register("r", bad, 0, 16)


def test_what_a_key_must_name(key):
    r = registry()
    path = SHM_DIR + key
    with pytest.raises(InvalidInputError, match="No such file"):
        r.register("r", key + "_gone", 0, 16)
    os.symlink(path, path + "_link")  # a link, even to a good object: not followed
    with pytest.raises(InvalidInputError, match="can open"):
        r.register("r", key + "_link", 0, 16)
    os.unlink(path + "_link")
    os.mkfifo(path + "_link")  # not a regular file (and opening it does not block)
    with pytest.raises(InvalidInputError, match="regular file"):
        r.register("r", key + "_link", 0, 16)
    with pytest.raises(InvalidInputError, match=r"^byte_size: expected offset \+ byte_size"):
        r.register("r", key, 1 << 15, (1 << 15) + 1)
    for field, args in (("offset", (-1, 16)), ("byte_size", (0, 0)), ("byte_size", (0, True))):
        with pytest.raises(InvalidInputError, match=f"^{field}: "):
            r.register("r", key, *args)
    assert len(r) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")
def test_an_object_of_another_user_is_refused(key):
    os.chown(SHM_DIR + key, 12345, -1)
    with pytest.raises(InvalidInputError, match="owned by this service's user"):
        registry().register("r", key, 0, 16)


def test_names_limits_status_and_unregister(key):
    r = registry(max_regions=2)
    r.register("a", key, 0, 1024)
    r.register("b", key.lstrip("/"), 4096, 1024)  # the same object twice is allowed, as Triton
    with pytest.raises(InvalidInputError, match="registered already"):
        r.register("a", key, 0, 16)
    with pytest.raises(InvalidInputError, match="at most 2 regions"):
        r.register("c", key, 0, 16)
    assert r.status(None) == [
        {"name": "a", "key": key, "offset": 0, "byte_size": 1024},
        {"name": "b", "key": key.lstrip("/"), "offset": 4096, "byte_size": 1024},
    ]
    assert r.get("a").inode == r.get("b").inode  # overlap checks see one memory
    with pytest.raises(NotFoundError, match="'zz'"):
        r.status("zz")
    r.unregister("zz")  # unknown: no error, as in Triton
    r.unregister("a")
    assert [s["name"] for s in r.status(None)] == ["b"]
    with pytest.raises(InvalidInputError, match=r"^q\.shared_memory_region: expected a registered"):
        r.resolve("q.shared_memory_region", "a")
    r.unregister(None)
    assert len(r) == 0


def test_reads_and_writes_go_through_the_descriptor_and_a_shrink_is_an_error(key):
    r = registry()
    r.register("a", key, 4096, 8192)
    region = r.get("a")
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    region.write(16, memoryview(cu.numpy()))
    with open(SHM_DIR + key, "rb") as f:
        f.seek(4096 + 16)
        assert f.read(12) == cu.numpy().tobytes()
    assert region.read("q_cu_seq_lens", 16, 12) == cu.numpy().tobytes()
    view = region.view(64, (4, 2), torch.float32)
    assert view.data_ptr() == region.buffer.base + 4096 + 64

    os.truncate(SHM_DIR + key, 4096 + 100)  # the owner shrinks it under the service
    with pytest.raises(InvalidInputError, match=r"^q: expected region 'a' .* shrunk to 4196"):
        region.check_size("q")
    with pytest.raises(InvalidInputError, match="shrunk"):
        region.read("q_cu_seq_lens", 1000, 12)  # pread reads short: no SIGBUS here
    region.write(8000, memoryview(b"x" * 16))  # pwrite grows it back rather than faulting
    assert os.stat(SHM_DIR + key).st_size == 4096 + 8016


def test_a_sparse_object_past_the_byte_cap_or_the_address_space_is_a_4xx(key):
    """A sparse object costs its owner nothing: registering 2^50 bytes of one is refused by the
    byte cap, and one the cap allows but no mapping can hold is refused the same way (422),
    never a 500."""
    os.truncate(SHM_DIR + key, 1 << 50)  # sparse: no memory
    with pytest.raises(InvalidInputError, match="byte_size"):
        registry().register("huge", key, 0, 1 << 50)
    with pytest.raises(InvalidInputError, match=r"byte_size.*map"):
        registry(max_bytes=1 << 62).register("huge", key, 0, 1 << 50)
    small = registry(max_regions=8, max_bytes=3 << 20)
    for i in range(3):
        small.register(f"r{i}", key, 0, 1 << 20)
    with pytest.raises(InvalidInputError, match=r"3145728 mapped"):
        small.register("r3", key, 0, 1 << 20)


def refusal(call: Callable[[CallerShm], object], regions: CallerShm) -> str:
    """What `call(regions)` raised, as its message (it must raise)."""
    with pytest.raises((InvalidInputError, NotFoundError)) as info:
        call(regions)
    return str(info.value)


def test_a_tenant_sees_names_and_unregisters_its_own_regions_only(key):
    shm = tenants()
    alice, bob = shm.of(ALICE), shm.of(BOB)
    alice.register("a", key, 0, 4096)
    mine = alice.status(None)
    assert mine == [{"name": "a", "key": key, "offset": 0, "byte_size": 4096}]

    # another's name is answered exactly as a name never registered (bob's own registry has
    # none: what he is told of "a" there is what he must be told of alice's "a")
    nobody = tenants().of(BOB)
    assert bob.status(None) == []
    for call in (
        lambda r: r.status("a"),
        lambda r: r.get("a"),
        lambda r: r.resolve("q.shared_memory_region", "a"),
        lambda r: r.place("q", "a", 0, 64, torch.bfloat16),
        lambda r: r.place("out", "a", 0, 64, torch.bfloat16),
    ):
        assert refusal(call, bob) == refusal(call, nobody)
    assert "region named 'a'" in refusal(lambda r: r.status("a"), bob)

    bob.unregister("a")
    bob.unregister(None)
    shm.of(None).unregister(None)  # as a caller no tenant names: none of a tenant's regions
    assert shm.of(None).status(None) == []
    assert alice.status(None) == mine
    assert alice.place("q", "a", 0, 64, torch.bfloat16) is alice.get("a")
    alice.unregister(None)
    assert len(shm) == 0


def test_an_object_one_tenant_registered_is_refused_to_another(key, other_key):
    shm = tenants()
    alice, bob = shm.of(ALICE), shm.of(BOB)
    alice.register("a", key, 0, 4096)
    alice.register("a2", key.lstrip("/"), 4096, 4096)  # her own object twice: as Triton
    os.link(SHM_DIR + key, SHM_DIR + key + "_link")  # another name of the same object
    for name in (key, key.lstrip("/"), key + "_link"):
        with pytest.raises(ForbiddenError, match="registered by another tenant"):
            bob.register("b", name, 0, 16)
    assert bob.status(None) == []
    bob.register("b", other_key, 0, 16)  # an object of his own
    with pytest.raises(ForbiddenError, match="registered by another tenant"):
        alice.register("c", other_key, 0, 16)
    alice.unregister(None)  # once she lets it go, it is anyone's to register
    bob.register("a", key, 0, 16)
    assert [r["name"] for r in bob.status(None)] == ["b", "a"]


def test_limits_count_per_tenant(key, other_key):
    shm = tenants(max_regions=2, max_bytes=16384)
    alice, bob = shm.of(ALICE), shm.of(BOB)
    alice.register("a", key, 0, 4096)
    alice.register("b", key, 4096, 4096)  # maps 8192 bytes: 12288 hers in all
    with pytest.raises(InvalidInputError, match="at most 2 regions"):
        alice.register("c", key, 0, 16)
    bob.register("a", other_key, 0, 8192)  # her regions and bytes are not his
    with pytest.raises(InvalidInputError, match=r"16384 bytes .* \(8192 mapped\)"):
        bob.register("b", other_key, 0, 8193)
    assert len(alice) == 2 and len(bob) == 1 and len(shm) == 3


def test_without_tenants_every_caller_is_one_caller(key):
    shm = SystemShmRegistry(
        max_regions=4, max_bytes=1 << 30, adopt=SharedBuffer.adopt, by_caller=False
    )
    one, two = shm.of(Caller.of("10.0.0.1")), shm.of(Caller.of("10.0.0.2"))
    one.register("a", key, 0, 4096)
    two.register("b", key, 4096, 4096)  # the same object: one caller
    assert [r["name"] for r in two.status(None)] == ["a", "b"]
    assert two.resolve("q.shared_memory_region", "a") is one.get("a")
    assert shm.of(None).status(None) == one.status(None)
    two.unregister(None)
    assert len(shm) == 0
