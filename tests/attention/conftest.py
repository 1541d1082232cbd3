"""The native kernel's tests run on every path of it this CPU runs: a test that takes the
`native_path` fixture runs once per path, "avx512" and "avx2" on an AVX-512 BF16 host, "avx2"
alone on an AVX2 host (EPYC Zen 2 / Zen 3), each forced as a user forces it
(`ZEN_MLA_NATIVE_ISA`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from zen_mla.attention.kernels import native


def _paths() -> list[str]:
    module = native.native_module()[0]
    return list(module.cpu_paths()) if module is not None else ["auto"]


def _forget_the_path() -> None:
    native.native_module.cache_clear()
    native.native_isa.cache_clear()


@pytest.fixture(params=_paths())
def native_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The path this test runs on, `ZEN_MLA_NATIVE_ISA` set to it meanwhile."""
    said = os.environ.get(native.ISA_VARIABLE)
    os.environ[native.ISA_VARIABLE] = request.param
    _forget_the_path()
    try:
        yield request.param
    finally:
        if said is None:
            os.environ.pop(native.ISA_VARIABLE, None)
        else:
            os.environ[native.ISA_VARIABLE] = said
        _forget_the_path()
