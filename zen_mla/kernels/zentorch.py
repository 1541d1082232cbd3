"""AMD zentorch's fused attention: scale, mask, softmax and both matmuls in one call."""

from __future__ import annotations

from typing import ClassVar

import torch

from .._status import zentorch_op, zentorch_status
from .base import AttentionKernel

__all__ = ["ZentorchKernel"]


class ZentorchKernel(AttentionKernel):
    """`torch.ops.zentorch.zentorch_sdpa`.

    Its second return is meant to be a log-sum-exp but holds uninitialised memory, so this
    kernel gives `out` only. Its `is_causal` is top-left aligned and it refuses bool masks: the
    driver passes bottom-right causal masks as additive masks of the query dtype.
    """

    name: ClassVar[str] = "zentorch"
    returns_lse: ClassVar[bool] = False
    needs_equal_head_dims: ClassVar[bool] = True
    # fp16 runs, but at bf16 precision (max error ~9x same-precision PyTorch's, measured)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float32)

    @classmethod
    def unavailable_reason(cls) -> str:
        status = zentorch_status()
        return "" if status["ops"]["zentorch_sdpa"] else str(status["reason"])

    @classmethod
    def forward(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
        return_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        op = zentorch_op()
        assert op is not None, "selected only where unavailable_reason() is ''"
        # Strided [n, H, S, D] views of the ragged [T, H, D] tensors are read in place: the
        # kernel takes any strides, so no per-request .contiguous() as in vLLM's loop.
        out, _garbage = op(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, None
