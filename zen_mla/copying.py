"""Copies of small CPU tensors on the calling thread, without waking torch's thread team.

`Tensor.copy_` splits any copy over 32k elements across the process's OpenMP threads. Between
two calls of an orchestrator those threads have gone to sleep, and waking them costs more than a
small copy itself (measured on a Zen 5 KVM guest, 2 threads, `OMP_WAIT_POLICY=PASSIVE`: 0.25 MiB
in 0.068 ms through `copy_`, 0.003 ms on one thread; 1 MiB 0.064 against 0.023; even at 4 MiB).
The client copies a call's tensors into its regions and its results out of them; for tensors of
a layer's call these copies are small, so they run here, on this thread, as numpy copies (which
never start threads). Larger ones, and any involving another device, go through `copy_`.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["SMALL_COPY_BYTES", "copied", "copy_into"]

#: the largest copy made on the calling thread; over it, the thread team's bandwidth pays
SMALL_COPY_BYTES = 2 << 20
#: an integer dtype of each element size, to see any tensor's bytes as numpy sees integers
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _on_this_thread(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (
        src.device.type == "cpu"
        and dst.device.type == "cpu"
        and src.dtype == dst.dtype
        and src.shape == dst.shape
        and src.element_size() in _SAME_SIZE
        and not src.is_conj()
        and not src.is_neg()
        and src.numel() * src.element_size() <= SMALL_COPY_BYTES
    )


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)`, made on this thread where both are CPU tensors of one dtype and shape
    and at most `SMALL_COPY_BYTES`; strides of either side are kept as `copy_` keeps them."""
    if not _on_this_thread(dst, src) or src.numel() == 0:
        return dst.copy_(src)
    as_int = _SAME_SIZE[src.element_size()]
    np.copyto(dst.detach().view(as_int).numpy(), src.detach().view(as_int).numpy())
    return dst


def copied(src: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of `src` (any device), as `src.to("cpu", copy=True)` makes one."""
    if src.device.type != "cpu":
        return src.to("cpu", copy=True)
    return copy_into(torch.empty(src.shape, dtype=src.dtype), src)
