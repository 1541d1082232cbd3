"""Shared memory for tensors crossing processes: anonymous memfd buffers, mapped by each side.

A memfd has no name in /dev/shm, so nothing can leak there: its pages are freed when the last
mapping and the last descriptor are gone, also when a worker is killed mid-request. Workers get
the descriptor over their pipe (SCM_RIGHTS) with each task.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._errors import ServiceUnavailableError

__all__ = ["BufferCache", "SharedBuffer", "TensorRef", "tensor_ref", "view"]

ALIGN = 64  # cache-line aligned tensor starts
_ids = itertools.count(1)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SharedBuffer:
    """`nbytes` of memory another process can map: an anonymous memfd, mapped here.

    `tensor(offset, shape, dtype)` gives views of it; `bytes_view` a writable memoryview (for
    reading a socket straight into it).
    """

    def __init__(self, nbytes: int, on_free: Callable[[int], None] | None = None) -> None:
        self.id = next(_ids)
        self.nbytes = nbytes
        self.fd = os.memfd_create(f"zen-mla-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(nbytes, 1))
            # pre-fault every page now, in one go: far cheaper than a fault per 4 KiB later
            flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
            self._map = mmap.mmap(self.fd, max(nbytes, 1), flags=flags)
        except BaseException:
            os.close(self.fd)
            raise
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.base = self._bytes.data_ptr()
        weakref.finalize(self, _free, self.fd, self.id, on_free)

    @property
    def bytes_view(self) -> memoryview:
        return memoryview(self._map)[: self.nbytes]

    def tensor(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        size = n * dtype.itemsize
        return self._bytes[offset : offset + size].view(dtype).view(*shape)

    def contains(self, t: torch.Tensor) -> bool:
        start = t.untyped_storage().data_ptr()
        return (
            self.base <= start and start + t.untyped_storage().nbytes() <= self.base + self.nbytes
        )


def _free(fd: int, buf_id: int, on_free: Callable[[int], None] | None) -> None:
    os.close(fd)
    if on_free is not None:
        on_free(buf_id)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where a tensor lies in a shared buffer, in a form a pipe carries (no tensor bytes)."""

    buffer: int  # SharedBuffer.id
    offset: int  # bytes from the buffer start to element 0
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # "bfloat16", ...


def tensor_ref(buf: SharedBuffer, t: torch.Tensor) -> TensorRef:
    # An empty tensor's data_ptr() is 0 wherever it lies: name offset 0, where any view of no
    # elements fits.
    return TensorRef(
        buf.id,
        t.data_ptr() - buf.base if t.numel() else 0,
        tuple(t.shape),
        tuple(t.stride()),
        str(t.dtype).removeprefix("torch."),
    )


def view(whole: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """The tensor `ref` names, as a view of `whole`, a uint8 tensor over its buffer."""
    dtype = getattr(torch, ref.dtype)
    assert ref.offset % dtype.itemsize == 0
    usable = whole.numel() // dtype.itemsize * dtype.itemsize  # a body may have any length
    typed = whole[:usable].view(dtype)
    return typed.as_strided(ref.shape, ref.stride, ref.offset // dtype.itemsize)


class BufferCache:
    """Released buffers kept for reuse, up to `max_bytes`: a fresh memfd costs a page fault per
    4 KiB on first touch (about 40 ms per 256 MiB here), a reused one does not."""

    def __init__(self, max_bytes: int, on_free: Callable[[int], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self._on_free = on_free
        self._free: list[SharedBuffer] = []
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> SharedBuffer:
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.nbytes <= 2 * nbytes + (1 << 20)]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._free.remove(best)
                return best
        try:
            return SharedBuffer(nbytes, self._on_free)
        except OSError as exc:  # out of descriptors (EMFILE, ENFILE) or memory (ENOMEM)
            raise ServiceUnavailableError(
                f"no shared memory for {nbytes} bytes: {exc.strerror or exc}", retry_after=1.0
            ) from exc

    def put(self, buf: SharedBuffer) -> None:
        with self._lock:
            self._free.append(buf)
            while sum(b.nbytes for b in self._free) > self.max_bytes:
                self._free.pop(0)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
