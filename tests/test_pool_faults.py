"""The pool under faults: empty tensors."""

from __future__ import annotations

import os

import pytest
import torch

import zen_mla
from tests.reference import assert_close_to_reference
from tests.test_attention import BatchSpec, make_batch
from zen_mla.pool import PoolConfig, WorkerPool

CPUS = sorted(os.sched_getaffinity(0))


#: batches with nothing in them somewhere: no requests, no queries, no keys, some of each
EMPTY_SPECS = {
    "no_requests": BatchSpec([], []),
    "no_queries": BatchSpec([0, 0], [5, 3]),
    "no_keys": BatchSpec([1], [0]),
    "no_keys_ragged": BatchSpec([3, 0, 2], [0, 0, 0]),
    "some_of_each": BatchSpec([0, 4, 3, 0, 2], [5, 0, 3, 0, 6]),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: the pool's reference kernel runs on 1 thread here, the in-process one on all: fp32 sums in
#: another order, so outputs may differ by a rounding step of their dtype
ATOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(PoolConfig(workers=min(2, len(CPUS)), ping_interval=0.2)) as p:
        yield p


# -- empty tensors ---------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("spec", EMPTY_SPECS.values(), ids=EMPTY_SPECS.keys())
def test_empty_tensors_as_in_process(pool, spec, dtype, return_lse, causal):
    q, k, v, q_cu, kv_cu = make_batch(spec, (2, 16, 8), dtype)
    want = zen_mla.ragged_attention(
        q, k, v, q_cu, kv_cu, causal=causal, return_lse=return_lse, kernel="reference"
    )
    want_out, want_lse = want if return_lse else (want, None)
    result = pool.run(
        q, k, v, q_cu, kv_cu, causal=causal, return_lse=return_lse, kernel="reference", timeout=60
    )
    try:
        assert result.out.shape == want_out.shape and result.out.dtype == dtype
        torch.testing.assert_close(result.out, want_out, atol=ATOL[dtype], rtol=ATOL[dtype])
        if return_lse:
            assert result.lse is not None and result.lse.shape == want_lse.shape
            torch.testing.assert_close(result.lse, want_lse, atol=1e-4, rtol=1e-4)
        else:
            assert result.lse is None
        assert_close_to_reference(q, k, v, q_cu, kv_cu, causal, result.out, result.lse)
    finally:
        result.release()
