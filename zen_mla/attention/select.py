"""Which kernel a request gets: the names a request may give, the kernel a name (or "auto")
resolves to on this host, and `KernelChoice`, what computes a request's `out` and `lse`. Like
vLLM's `selector.py`, selection stands apart from what it selects: what this host offers is
probed in `probes.py`, what "auto" takes is worked out in `auto.py`, each kernel judges the
facts itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidInputError, KernelUnavailableError
from . import probes
from .auto import auto_choice, cannot_run
from .kernels import KERNELS, AttentionKernel

__all__ = [
    "KERNEL_NAMES",
    "KernelChoice",
    "kernel_choice",
    "select_kernel",
]

KERNEL_NAMES = ("auto", *KERNELS)


def select_kernel(kernel: str, dtype: torch.dtype, *, return_lse: bool) -> type[AttentionKernel]:
    """The kernel that computes `out` (and `lse`) for a request naming `kernel`.

    "auto" takes, of the registered kernels that run here, suit "auto" and compute `dtype` at
    their own precision (with `return_lse`, also give a trusted LSE), the one the calibration
    measured fastest (`attention.calibrate`; the first where it is off). A named kernel that
    cannot run raises KernelUnavailableError with its reason. With `return_lse`, a named kernel
    whose LSE is not trusted here (zentorch where its probe failed) hands the whole batch
    (out and lse from one softmax, so they merge consistently) to the kernel "auto" would take
    for an LSE: torch's flash kernel.
    """
    if kernel not in KERNEL_NAMES:
        raise InvalidInputError("kernel", f"one of {', '.join(KERNEL_NAMES)}", repr(kernel))
    # read from the module, as `status.host_status` reads it: one stand-in there reaches both
    host = probes.host_facts()
    if kernel == "auto":
        return auto_choice(host, dtype, lse=return_lse).kernel
    chosen = KERNELS[kernel]
    reason = cannot_run(chosen, host, dtype)
    if reason is not None:
        raise KernelUnavailableError(
            "kernel",
            f"a kernel that runs here ({kernel!r} cannot: {reason})",
            repr(kernel),
            'Use kernel="auto" to take the best available one',
        )
    if return_lse and chosen.lse_unavailable_reason(host) is not None:
        return auto_choice(host, dtype, lse=True).kernel
    return chosen


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """What computes a request's `out` and, when asked, its `lse` (None when not asked)."""

    out: str
    lse: str | None

    @classmethod
    def of(cls, kernel: type[AttentionKernel], *, return_lse: bool) -> KernelChoice:
        """`kernel` computes `out`, and `lse` where `return_lse` asks for it (one kernel computes
        both, from one softmax: `select_kernel`'s answer)."""
        return cls(kernel.name, kernel.name if return_lse else None)


def kernel_choice(
    kernel: str = "auto", dtype: torch.dtype = torch.bfloat16, *, return_lse: bool = False
) -> KernelChoice:
    """The kernels `ragged_attention(..., kernel=kernel, return_lse=return_lse)` runs for
    inputs of `dtype` on this host; raises as `ragged_attention` would."""
    chosen = select_kernel(kernel, dtype, return_lse=return_lse)
    return KernelChoice.of(chosen, return_lse=return_lse)
