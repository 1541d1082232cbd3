"""The region registry's limits and checks, and the region socket's folder rules, with real
memfds (no server)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from zen_mla import InvalidInputError
from zen_mla._memfd import create_sealed_memfd
from zen_mla.pool import SharedBuffer
from zen_mla.region_request import TensorPlace
from zen_mla.region_server import RegionServer
from zen_mla.regions import RegionRegistry, check_disjoint


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
        check_disjoint(
            {"q": TensorPlace(h, 0, "F32", (8,)), "out": TensorPlace(h, 28, "F32", (8,))},
            ("out",),
        )
    check_disjoint(
        {"q": TensorPlace(h, 0, "F32", (8,)), "out": TensorPlace(h, 32, "F32", (8,))}, ("out",)
    )


def test_the_socket_folder_must_be_ours_and_closed_to_others(tmp_path):
    registry = RegionRegistry(max_regions=1, max_bytes=1, adopt=SharedBuffer.adopt)
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o777)

    async def start(path):
        server = RegionServer(str(path), registry, token=None, max_clients=1, instance="x")
        server.start()
        mode = os.stat(path).st_mode & 0o777
        server.close()
        return mode, os.path.exists(path)

    with pytest.raises(PermissionError, match="others cannot"):
        asyncio.run(start(open_folder / "regions.sock"))
    made = tmp_path / "made" / "here"
    assert asyncio.run(start(made / "regions.sock")) == (0o600, False)
    assert os.stat(made).st_mode & 0o777 == 0o700
