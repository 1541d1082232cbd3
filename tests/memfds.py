"""Memfds that a region registry must refuse to map, for the registry's tests (tests/regions/)
and the service's (tests/service/): each case of UNMAPPABLE makes one and says what its
refusal names."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from zen_mla.regions.memfd import create_sealed_memfd


def sealed(seals: int, nbytes: int = 4096, flags: int = 0, name: str = "x") -> int:
    """A memfd called `name` of `nbytes` (no page behind them yet) with `seals` (F_SEAL_*)
    added; `flags`: memfd_create's, beyond MFD_CLOEXEC and MFD_ALLOW_SEALING."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def read_only() -> int:
    """A sealed memfd reopened read-only (through /proc), its read-write descriptor closed."""
    fd = create_sealed_memfd(4096)
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)


def hugetlb() -> int:
    """A hugetlb memfd on a machine with no huge pages (the test is skipped where it has some:
    there it maps)."""
    if Path("/proc/sys/vm/nr_hugepages").read_text().strip() != "0":
        pytest.skip("this machine has huge pages: a hugetlb memfd maps")
    return sealed(fcntl.F_SEAL_SHRINK, 2 << 20, os.MFD_HUGETLB)


#: how to make a memfd that cannot be mapped, and a pattern its refusal's message matches
UNMAPPABLE: dict[str, tuple[Callable[[], int], str]] = {
    "zero_bytes": (lambda: create_sealed_memfd(0), "at least 1 byte"),
    "sealed_against_writing": (
        lambda: sealed(fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE),
        "sealed against writing",
    ),
    "reopened_read_only": (read_only, "read-write"),
    "hugetlb_without_huge_pages": (hugetlb, "holes.* huge pages"),
}
