"""The sealed memfds behind regions (zen_mla.regions.memfd): made sealed against shrinking and
growing, and anything else refused with a named error."""

from __future__ import annotations

import fcntl
import os

import pytest

from zen_mla import InvalidInputError
from zen_mla.regions.memfd import check_sealed_memfd, create_sealed_memfd


def test_a_sealed_memfd_passes_and_anything_else_is_named():
    fd = create_sealed_memfd(4096)
    try:
        assert check_sealed_memfd(fd) == 4096
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seals == seals
        for size in (1024, 8192):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)  # the seals hold
    finally:
        os.close(fd)
    unsealed = os.memfd_create("x", os.MFD_CLOEXEC)
    r, w = os.pipe()
    try:
        with pytest.raises(InvalidInputError, match="can shrink"):
            check_sealed_memfd(unsealed)
        with pytest.raises(InvalidInputError, match="pipe"):
            check_sealed_memfd(r)
    finally:
        for fd in (unsealed, r, w):
            os.close(fd)
