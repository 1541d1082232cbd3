"""The fp32 reference: matmul, mask, softmax, matmul, log-sum-exp, one query block at a time."""

from __future__ import annotations

from typing import ClassVar

import torch

from ..host import HostFacts
from .base import AttentionKernel, CallShape, KernelCall

__all__ = ["ReferenceKernel"]

#: fp32 scores held at once; vLLM's reference path holds all of `[H, Sq, Sk]` (4 GiB at 8192^2)
SCORE_BUDGET_BYTES = 64 << 20


class ReferenceKernel(AttentionKernel):
    """vLLM's fp32 per-sequence path, blocked over queries so memory stays bounded."""

    name: ClassVar[str] = "reference"
    needs_equal_head_dims: ClassVar[bool] = False

    @classmethod
    def auto_unsuited_reason(cls, host: HostFacts) -> str | None:
        return "the reference kernel is fp32 math for checking, never taken by 'auto'"

    @classmethod
    def call_bytes(cls, shape: CallShape, threads: int) -> int:
        # fp32 copies of K and V, fp32 out and lse, out in q's dtype, one block of scores
        # (with its log-sum-exp and the block of q in fp32 beside it)
        rows = shape.n * shape.heads
        copies = rows * shape.sk * (shape.dqk + shape.dv) * 4
        results = rows * shape.sq * (shape.dv * (4 + shape.itemsize) + 4)
        block = max(SCORE_BUDGET_BYTES, rows * shape.sk * 4)
        block_rows = min(shape.sq, max(1, SCORE_BUDGET_BYTES // (4 * rows * max(shape.sk, 1))))
        q_block = block_rows * rows * (shape.dqk + 1) * 4
        return copies + results + 2 * block + q_block

    @classmethod
    def forward(cls, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v, mask, causal, scale = call.q, call.k, call.v, call.mask, call.causal, call.scale
        n, h, sq, _ = q.shape
        sk = k.shape[2]
        # One dense fp32 copy each: matmuls on the strided heads-first views are far slower.
        k_t = k.to(torch.float32, memory_format=torch.contiguous_format).transpose(-1, -2)
        v32 = v.to(torch.float32, memory_format=torch.contiguous_format)
        out = torch.empty(n, h, sq, v.shape[-1], dtype=torch.float32)
        lse = torch.empty(n, h, sq, dtype=torch.float32)
        rows = max(1, SCORE_BUDGET_BYTES // (4 * n * h * max(sk, 1)))
        cols = torch.arange(sk)
        for a in range(0, sq, rows):
            b = min(sq, a + rows)
            seen = b if causal else sk  # top-left triangle: keys past the block's last query
            q32 = q[:, :, a:b].to(torch.float32, memory_format=torch.contiguous_format)
            scores = torch.matmul(q32, k_t[..., :seen]).mul_(scale)  # [n, H, b - a, seen]
            if causal:
                hidden = cols[None, :seen] > torch.arange(a, b)[:, None]
                scores.masked_fill_(hidden, float("-inf"))
            if mask is not None:
                scores.add_(mask[a:b].float())
            block_lse = torch.logsumexp(scores, dim=-1)
            probs = scores.sub_(block_lse.unsqueeze(-1)).exp_()
            out[:, :, a:b] = torch.matmul(probs, v32[:, :, :seen])
            lse[:, :, a:b] = block_lse
        return out.to(q.dtype), (lse if call.return_lse else None)
