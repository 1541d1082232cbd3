"""Ragged batches for the tests, by named case: random q/k/v in the flash-attn varlen layout
with their cumulative sequence lengths. No pytest here: the benchmarks build theirs with it
too (bench/_common.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchSpec:
    q_lens: list[int]
    kv_lens: list[int] | None = None  # None: the same as q_lens (self-attention)


BATCH_SPECS = {
    "single": BatchSpec([37]),
    "ragged": BatchSpec([5, 64, 1, 33, 130]),
    "length_one": BatchSpec([1, 1, 1]),
    "empty_requests": BatchSpec([0, 7, 0, 12, 0]),
    "no_requests": BatchSpec([]),
    "equal_runs": BatchSpec([16, 16, 16, 16, 9, 9, 16]),
    "prefix_cached": BatchSpec([3, 16, 40, 1], [10, 16, 100, 64]),
    "more_queries_than_keys": BatchSpec([10, 5, 6], [4, 0, 6]),
    "context_chunk": BatchSpec([8, 20, 0], [50, 70, 9]),
}

#: batches with nothing in them somewhere: no requests, no queries, no keys, some of each
EMPTY_SPECS = {
    "no_requests": BatchSpec([], []),
    "no_queries": BatchSpec([0, 0], [5, 3]),
    "no_keys": BatchSpec([1], [0]),
    "no_keys_ragged": BatchSpec([3, 0, 2], [0, 0, 0]),
    "some_of_each": BatchSpec([0, 4, 3, 0, 2], [5, 0, 3, 0, 6]),
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cu_seq_lens(lens: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`[len(lens) + 1]` of `dtype`: 0, then the running sums of `lens`."""
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype)


def make_batch(spec: BatchSpec, heads: tuple[int, int, int], dtype: torch.dtype, seed: int = 0):
    """q `[Tq, H, Dqk]`, k `[Tk, H, Dqk]`, v `[Tk, H, Dv]` of `dtype` for `heads = (H, Dqk, Dv)`;
    q_cu int32; kv_cu int64, or None where the spec has no kv_lens."""
    h, dqk, dv = heads
    kv_lens = spec.kv_lens if spec.kv_lens is not None else spec.q_lens
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(spec.q_lens), sum(kv_lens)
    q = torch.randn(tq, h, dqk, generator=gen).to(dtype)
    k = torch.randn(tk, h, dqk, generator=gen).to(dtype)
    v = torch.randn(tk, h, dv, generator=gen).to(dtype)
    q_cu = cu_seq_lens(spec.q_lens, torch.int32)
    kv_cu = None if spec.kv_lens is None else cu_seq_lens(kv_lens)
    return q, k, v, q_cu, kv_cu
