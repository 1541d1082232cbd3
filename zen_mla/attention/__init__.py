"""Ragged MLA prefill attention in this process: `ragged_attention` (validate, select, attend).

batch.py    the varlen batch and its rules (RaggedBatch, validate)
driver.py   a validated batch through one kernel (attend)
host.py     this host's facts, as the kernels judge whether they can run (CpuFacts, HostFacts)
probes.py   the start-up probes that find those facts, once per process (host_facts)
auto.py     what "auto" takes here, and why (the calibration among the kernels that suit it)
select.py   the kernel a request naming one gets (select_kernel, KernelChoice)
status.py   what this host reports of its kernels (HostStatus, host_kernels)
kernels/    one file per kernel
merge.py    merging attention over parts of the keys by their LSE (vLLM's merge_attn_states)
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from .batch import RaggedBatch, validate
from .driver import attend
from .select import KernelChoice, kernel_choice, select_kernel
from .status import HostStatus, host_kernels, host_status, zentorch_status

__all__ = [
    "HostStatus",
    "KernelChoice",
    "PrefillOutput",
    "RaggedBatch",
    "host_kernels",
    "host_status",
    "kernel_choice",
    "ragged_attention",
    "select_kernel",
    "validate",
    "zentorch_status",
]

#: what `ragged_attention` (and every client of the service) returns: out, or (out, lse)
PrefillOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@overload
def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None = None,
    *,
    causal: bool = True,
    return_lse: Literal[False] = False,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor: ...
@overload
def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None = None,
    *,
    causal: bool = True,
    return_lse: Literal[True],
    scale: float | None = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]: ...
def ragged_attention(
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
) -> PrefillOutput:
    """Attention over a ragged ("varlen") batch of `B` sequences, as flash-attn's varlen API.

    Args:
        q: `[Tq, H, Dqk]`, bf16, fp16 or fp32.
        k: `[Tk, H, Dqk]`, q's dtype.
        v: `[Tk, H, Dv]`, q's dtype, `Dv <= Dqk` (MLA: Dqk = 192, Dv = 128).
        q_cu_seq_lens: `[B + 1]` int32/int64 offsets into q, `0 = c[0] <= ... <= c[B] = Tq`.
        kv_cu_seq_lens: `[B + 1]` offsets into k/v; None means `q_cu_seq_lens`.
        causal: query i of a sequence sees keys `j <= i + Sk - Sq` (bottom-right aligned).
        return_lse: also return the softmax log-sum-exp, fp32-accurate whatever `kernel`.
        scale: score scale, default `Dqk ** -0.5`.
        kernel: "auto" | "native" | "zentorch" | "torch" | "reference", what computes `out`.

    Returns:
        out `[Tq, H, Dv]` in v's dtype, or `(out, lse)` with lse `[H, Tq]` fp32 (natural log).
        Queries that see no key get `out = 0`, `lse = -inf`.

    Raises:
        InvalidInputError (a ValueError) naming the tensor or argument at fault;
        KernelUnavailableError when `kernel` names one that cannot run here.
    """
    batch = validate(q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal=causal, scale=scale)
    chosen = select_kernel(kernel, batch.q.dtype, return_lse=return_lse)
    out, lse = attend(batch, chosen, return_lse=return_lse)
    if return_lse:
        assert lse is not None  # attend allocates it when asked
        return out, lse
    return out
