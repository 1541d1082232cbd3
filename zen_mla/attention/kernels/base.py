"""What every attention kernel offers the ragged-batch driver."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["AttentionKernel", "KernelCall"]


@dataclass(frozen=True, slots=True)
class KernelCall:
    """One kernel call over `n` equal-length requests of a batch.

    q: `[n, H, Sq, D]`, k: `[n, H, Sk, D]`, v: `[n, H, Sk, Dv]` (any strides, unit last
    stride). `causal` is the top-left triangle and comes only with `Sq == Sk`; other masks come
    as `mask`, an additive `[Sq, Sk]` tensor of q's dtype (0 or -inf) that leaves every query at
    least one key. `return_lse` is asked only where the selector found the kernel's LSE
    fp32-accurate.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    causal: bool
    mask: torch.Tensor | None
    return_lse: bool


class AttentionKernel:
    """One dense attention kernel over a batch of equal-length requests.

    Capabilities are class-level; whether a kernel can run on this host (and give an LSE) is
    the selector's business (`attention.select`), decided once per process, so the driver
    never re-checks per call.
    """

    name: ClassVar[str]
    #: wants `Dv == Dqk`: the driver pads V once per batch and slices the padding off `out`
    needs_equal_head_dims: ClassVar[bool]
    #: input dtypes computed at their own precision
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16, torch.float32)

    @classmethod
    def forward(cls, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of `call`'s requests: out `[n, H, Sq, Dv]` in q's dtype (any strides)
        and, when `call.return_lse`, lse `[n, H, Sq]` fp32."""
        raise NotImplementedError
