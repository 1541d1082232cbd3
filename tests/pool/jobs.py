"""Batches put on a `WorkerPool` the way `PrefillEngine.run` puts them there: validated by
`zen_mla.attention.validate`, a kernel chosen by `select_kernel`, then `submit_batch`
(arguments as `zen_mla.ragged_attention`)."""

from __future__ import annotations

from concurrent.futures import CancelledError
from typing import Any

import torch

from zen_mla.attention import select_kernel, validate
from zen_mla.pool import PoolJob, PoolResult, SharedBuffer, WorkerPool


def small_batch(seed: int = 0, tokens: int = 9):
    """Two causal requests of 16 MLA heads in bf16 (q, k, v, q_cu_seq_lens): a task of one."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, 16, 192, generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(tokens, 16, 128, generator=g, dtype=torch.bfloat16)
    return q, k, v, torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)


def submit(
    pool: WorkerPool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None = None,
    *,
    causal: bool = True,
    return_lse: bool = False,
    scale: float | None = None,
    kernel: str = "auto",
    inputs: SharedBuffer | None = None,
) -> PoolJob:
    """Validate, select and queue; errors of the validation or the choice are raised here,
    before the pool sees the batch."""
    batch = validate(q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal=causal, scale=scale)
    chosen = select_kernel(kernel, batch.q.dtype, return_lse=return_lse)
    return pool.submit_batch(batch, chosen.name, return_lse=return_lse, inputs=inputs)


def run(
    pool: WorkerPool,
    *args: Any,
    timeout: float | None = None,
    **kwargs: Any,
) -> PoolResult:
    """`submit(pool, ...)` and wait; past `timeout` the job is abandoned and TimeoutError
    raised."""
    job = submit(pool, *args, **kwargs)
    try:
        return job.result(timeout)
    except (TimeoutError, CancelledError):
        job.cancel()
        raise
