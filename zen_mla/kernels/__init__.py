"""Attention kernels, one file each, and the choice between them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._errors import InvalidInputError, KernelUnavailableError
from .._status import zentorch_status
from .base import AttentionKernel
from .reference import ReferenceKernel
from .torch_flash import TorchFlashKernel
from .zentorch import ZentorchKernel

__all__ = [
    "KERNELS",
    "KERNEL_NAMES",
    "AttentionKernel",
    "KernelChoice",
    "ReferenceKernel",
    "TorchFlashKernel",
    "ZentorchKernel",
    "kernel_choice",
    "select_kernel",
]

KERNELS: dict[str, type[AttentionKernel]] = {
    k.name: k for k in (ZentorchKernel, TorchFlashKernel, ReferenceKernel)
}
KERNEL_NAMES = ("auto", *KERNELS)


def select_kernel(kernel: str, dtype: torch.dtype, *, return_lse: bool) -> type[AttentionKernel]:
    """The kernel that computes `out` (and `lse`) for a request naming `kernel`.

    "auto" follows `zentorch_status()["auto_kernel"]`, falling back to torch for a dtype the
    chosen kernel would compute at lower precision. With `return_lse`, a kernel whose LSE is
    not fp32-accurate here (`lse_unavailable_reason()`: zentorch where its probe failed) hands
    the whole request (out and lse from one softmax, so they merge consistently) to torch's
    flash kernel.
    """
    if kernel not in KERNEL_NAMES:
        raise InvalidInputError("kernel", f"one of {', '.join(KERNEL_NAMES)}", repr(kernel))
    name = zentorch_status()["auto_kernel"] if kernel == "auto" else kernel
    chosen = KERNELS[name]
    if kernel == "auto" and dtype not in chosen.dtypes:
        chosen = TorchFlashKernel
    reason = chosen.unavailable_reason()
    if not reason and dtype not in chosen.dtypes:
        reason = f"it computes {dtype} at lower precision"
    if reason:
        raise KernelUnavailableError(
            "kernel",
            f"a kernel that runs here ({kernel!r} cannot: {reason})",
            repr(kernel),
            'Use kernel="auto" to take the best available one',
        )
    if return_lse and chosen.lse_unavailable_reason():
        return TorchFlashKernel
    return chosen


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """What computes a request's `out` and, when asked, its `lse` (None when not asked)."""

    out: str
    lse: str | None


def kernel_choice(
    kernel: str = "auto", dtype: torch.dtype = torch.bfloat16, *, return_lse: bool = False
) -> KernelChoice:
    """The kernels `ragged_attention(..., kernel=kernel, return_lse=return_lse)` runs for
    inputs of `dtype` on this host; raises as `ragged_attention` would."""
    chosen = select_kernel(kernel, dtype, return_lse=return_lse)
    return KernelChoice(chosen.name, chosen.name if return_lse else None)
