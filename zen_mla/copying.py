"""Copies of a call's CPU tensors on the calling thread, without waking torch's thread team.

`Tensor.copy_` splits any copy of over 32,768 elements across the process's OpenMP threads, and
that costs a caller of the service twice over. Between two calls of an orchestrator its threads
have gone to sleep, and waking them costs more than a small copy itself; and unless the caller
set `OMP_WAIT_POLICY=PASSIVE`, they spin after each copy on the cores the service's workers
compute on. Measured on a Zen 5 KVM guest (2 threads): with PASSIVE, 32,768 bf16 elements copy
in 1.6 us, 32,769 in 50 us, 1 MiB in 0.064 ms against 0.023 on one thread; with OpenMP's
default, a 64-token call through the region socket took 7.4-8.0 ms with its copies through
`copy_` and 1.2-1.3 ms with them here (`bench/copies.py`). So the client's copies into its
regions and out of them run here, as numpy copies (which never start threads), up to
`SMALL_COPY_BYTES`: the tensors of a layer's call of up to ~340 tokens (H=16, Dqk=192). Copies
torch keeps on one thread anyway (32,768 elements or fewer, where numpy's ~4 us of setup would
cost more), larger ones (where two threads already copied faster here, out of memory the cache
no longer held: a 16 MiB bound cost the `mixed` batch's copies 4.8 ms more, `bench/e2e.py`)
and any involving another device go through `copy_`.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["SMALL_COPY_BYTES", "TORCH_GRAIN", "copied", "copy_into"]

#: the largest copy made on the calling thread; over it, a thread team's bandwidth pays
SMALL_COPY_BYTES = 2 << 20
#: the most elements `copy_` copies without starting its thread team (`at::internal::GRAIN_SIZE`)
TORCH_GRAIN = 32768
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
        and src.numel() > TORCH_GRAIN
        and src.numel() * src.element_size() <= SMALL_COPY_BYTES
    )


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)`, made on this thread where both are CPU tensors of one dtype and shape,
    of more than `TORCH_GRAIN` elements and at most `SMALL_COPY_BYTES`; strides of either side
    are kept as `copy_` keeps them."""
    if not _on_this_thread(dst, src):
        return dst.copy_(src)
    as_int = _SAME_SIZE[src.element_size()]
    np.copyto(dst.detach().view(as_int).numpy(), src.detach().view(as_int).numpy())
    return dst


def copied(src: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of `src` (any device), as `src.to("cpu", copy=True)` makes one."""
    if src.device.type != "cpu":
        return src.to("cpu", copy=True)
    return copy_into(torch.empty(src.shape, dtype=src.dtype), src)
