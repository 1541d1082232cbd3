"""A worker mapping a client's memfd that was sealed against writing after the service checked
it (`_worker._Mapped.map`): the refusal crosses back as the invalid input it is (422), through
the one translation of a worker's errors, not as a kernel failure (500)."""

from __future__ import annotations

import fcntl
import os

import pytest

from zen_mla import InvalidInputError
from zen_mla.errors import from_parts, parts_of, status_of
from zen_mla.pool._worker import _Mapped
from zen_mla.regions.memfd import create_sealed_memfd

_F_SEAL_FUTURE_WRITE = 0x0010  # <linux/fcntl.h>; Python's fcntl names it from 3.12


def test_a_memfd_sealed_against_writing_is_invalid_input_and_maps_nothing():
    fd = create_sealed_memfd(1 << 16)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE)
        mapped = _Mapped()
        given = os.dup(fd)
        with pytest.raises(InvalidInputError, match="sealed against writing") as refused:
            mapped.map(7, given, 1 << 16, populate=False)
        with pytest.raises(OSError):
            os.fstat(given)  # closed all the same: the worker owns what it was sent
        crossed = from_parts(*parts_of(refused.value))
        assert isinstance(crossed, InvalidInputError) and status_of(crossed) == 422
        assert crossed.name == "region"
        mapped.map(8, create_sealed_memfd(1 << 16), 1 << 16, populate=False)  # the next maps
    finally:
        os.close(fd)
