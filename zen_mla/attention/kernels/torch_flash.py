"""PyTorch's CPU flash attention: the fallback where zentorch is absent, and the LSE path."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import AttentionKernel, CallShape, KernelCall

__all__ = ["TorchFlashKernel"]


class TorchFlashKernel(AttentionKernel):
    """`aten::_scaled_dot_product_flash_attention_for_cpu`, the kernel behind
    `F.scaled_dot_product_attention` on CPU, called directly for its second output.

    It tiles queries and keys, multiplies bf16/fp16 blocks with fp32 accumulation and keeps the
    running max and sum in fp32, so its log-sum-exp is fp32-accurate (measured within 1e-4 of
    fp64 for bf16 inputs), in memory bounded by its tiles, never `[H, Sq, Sk]`.
    """

    name: ClassVar[str] = "torch"
    needs_equal_head_dims: ClassVar[bool] = True
    auto_reason: ClassVar[str] = "torch's flash kernel runs on every CPU"

    @classmethod
    def call_bytes(cls, shape: CallShape, threads: int) -> int:
        return shape.flash_bytes(threads)

    @classmethod
    def forward(cls, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            call.q, call.k, call.v, 0.0, call.causal, attn_mask=call.mask, scale=call.scale
        )
        return out, (lse if call.return_lse else None)
