"""V padded to Q's head dim for the fused kernels, in memory kept from one batch to the next.

A fresh padded copy of a large V costs more in page faults than in copying: glibc maps any
allocation over 32 MiB afresh, and each 4 KiB page faults on first touch (measured on a Zen 5
KVM guest: padding `chunk`'s V, 8192 x 16 x 128 bf16, took 16 ms into fresh memory and 1.2 ms
into reused memory; vLLM's loop pads per sequence, 12 MiB at a time, which glibc recycles).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["KEEP_BYTES", "padded"]

KEEP_BYTES = 256 << 20  # the most a process keeps between batches


class _KeptBuffer:
    """The one flat buffer a process keeps between batches (made outside inference mode)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.buf: torch.Tensor | None = None

    def take(self, size: int) -> torch.Tensor | None:
        """The kept buffer, when it is free and holds `size` bytes (it is in use until `give`)."""
        with self._lock:
            buf = self.buf
            if buf is None or buf.numel() < size:
                return None
            self.buf = None
            return buf

    def give(self, buf: torch.Tensor) -> None:
        """Keep `buf`: the larger, when two threads padded at once."""
        with self._lock:
            if self.buf is None or self.buf.numel() < buf.numel():
                self.buf = buf


_kept = _KeptBuffer()


@contextmanager
def padded(v: torch.Tensor, head_dim: int) -> Iterator[torch.Tensor]:
    """`v` `[T, H, Dv]` zero-padded to `[T, H, head_dim]`, for the block's length. The memory
    is the process's kept buffer when it is free and large enough (else fresh memory), and the
    padded tensor is not an inference tensor (zentorch's LSE route needs one that can require
    grad). Nothing may keep it past the block."""
    t, h, dv = v.shape
    size = t * h * head_dim * v.element_size()
    buf = _kept.take(size)
    if buf is None and size <= KEEP_BYTES:
        buf = _new(size)  # kept in place of a smaller one
    try:
        with torch.inference_mode(False):
            if buf is None:
                out = torch.nn.functional.pad(v, (0, head_dim - dv))
            else:
                out = buf[:size].view(v.dtype).view(t, h, head_dim)
                out[..., :dv].copy_(v)
                out[..., dv:].zero_()
        yield out
    finally:
        if buf is not None:
            _kept.give(buf)


def _new(size: int) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.empty(size, dtype=torch.uint8)
