"""Shared memory for tensors crossing processes: anonymous memfd buffers, mapped by each side.

A memfd has no name in /dev/shm, so nothing can leak there: its pages are freed when the last
mapping and the last descriptor are gone, also when a worker is killed mid-request. Workers get
the descriptor over their pipe (SCM_RIGHTS) with a task that names a buffer they have not
mapped, and keep it mapped until told to forget it (`WorkerMappings`). A client's memfd
(`SharedBuffer.adopt`) is unmapped here once its region has ended (`release()`) and no request
holds the buffer, not when the last view of it is collected.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch

from ..errors import ServiceUnavailableError
from ._messages import TensorRef

__all__ = ["BufferCache", "SharedBuffer", "WorkerMappings", "tensor_ref", "view"]

ALIGN = 64  # cache-line aligned tensor starts
_ids = itertools.count(1)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SharedBuffer:
    """`nbytes` of memory another process can map: an anonymous memfd, mapped here.

    `tensor(offset, shape, dtype)` gives views of it; `bytes_view` a writable memoryview (for
    reading a socket straight into it). A buffer of the pool's own is pre-faulted (`populate`)
    unless made with `prefault=False`, which leaves it to `fault_in()` as it is filled (a body
    whose bytes have not come yet then holds no memory); one adopted from a client (`adopt()`)
    is not: its pages are the client's, faulted in as they are used, and `release()` gives
    them up when the client's region ends.
    """

    def __init__(
        self,
        nbytes: int,
        on_free: Callable[[int], None] | None = None,
        *,
        prefault: bool = True,
        _fd: int | None = None,
    ) -> None:
        self.id = next(_ids)
        self.nbytes = nbytes
        self.populate = _fd is None
        self.fd = os.memfd_create(f"zen-mla-{self.id}", os.MFD_CLOEXEC) if _fd is None else _fd
        try:
            if self.populate:
                os.ftruncate(self.fd, max(nbytes, 1))
                self._map = mmap.mmap(self.fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
                start, span = 0, max(nbytes, 1)
            else:
                self._map, start, span = _map_over(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self._start = start
        self._bytes = torch.frombuffer(
            self._map, dtype=torch.uint8, count=max(nbytes, 1), offset=start
        )
        self.base = self._bytes.data_ptr()
        self.faulted = 0  # bytes from the start known to be faulted in
        if self.populate and prefault:
            self.fault_in(nbytes)
        client = None if self.populate else (self._map, self.base, span)
        self._end = _End(self.fd, self.id, on_free, client)
        weakref.finalize(self, self._end)

    @classmethod
    def adopt(
        cls, fd: int, nbytes: int, on_free: Callable[[int], None] | None = None
    ) -> SharedBuffer:
        """A buffer over a memfd someone else made (`fd` is the buffer's from now on); the
        caller has checked that it cannot shrink below `nbytes`."""
        return cls(nbytes, on_free, _fd=fd)

    def release(self) -> None:
        """An adopted buffer's region ended. Once the object is freed, which is at once where
        no request in flight or task still queued holds it, the client's pages are unmapped
        here even under a view of them left over (a job's result in a reference cycle would
        keep them till the next garbage collection; the view then reads zeros), and the pool
        is told (`on_free`: the workers unmap them with their next task, or while idle)."""
        if not self.populate:
            self._end.released = True

    def fault_in(self, upto: int) -> None:
        """Fault the pages of bytes `[faulted, upto)` in now, in one go (a buffer of the pool's
        own; an adopted one is the client's memory and never faulted in here)."""
        upto = min(upto, max(self.nbytes, 1))
        if self.populate and upto > self.faulted:
            page = mmap.PAGESIZE
            start = self.faulted // page * page
            _prefault(self.base + start, upto - start)
            self.faulted = upto

    @property
    def bytes_view(self) -> memoryview:
        return memoryview(self._map)[self._start : self._start + self.nbytes]

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


_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
_MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x10, 0x20, 0x4000  # <linux/mman.h>, x86 and arm64
_MAP_FAILED = ctypes.c_void_p(-1).value


def _prefault(address: int, nbytes: int) -> None:
    """Fault every page in now, in one go: far cheaper than a fault per 4 KiB later. Through
    ctypes, which lets go of the GIL for the call: `mmap(MAP_POPULATE)` holds it throughout
    (measured: a fresh 1 GiB buffer stalled the event loop 0.7-1.5 s). Where the kernel lacks
    MADV_POPULATE_WRITE the pages fault in on first use instead."""
    _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _MADV_POPULATE_WRITE)


def _map_over(fd: int, nbytes: int) -> tuple[mmap.mmap, int, int]:
    """A client's memfd `fd` mapped shared, read-write: the mmap object whose range holds it,
    where in that range it starts, and how many bytes of it are mapped.

    Python's `mmap.mmap(fd)` keeps a descriptor of the file for the object's life, which a
    view kept past the region's end (a job's result in a reference cycle, say) would stretch
    to the next garbage collection, and the client's memory with it. So the mmap object here is
    an anonymous reservation that holds no descriptor, and the memfd is mapped over part of it
    (MAP_FIXED), where `_unmap_client` can take it away again; the object unmaps the whole
    range once freed. The start is aligned to the file's block size: a hugetlb memfd maps only
    at a huge page's boundary, and in whole huge pages."""
    align = max(os.fstat(fd).st_blksize, mmap.PAGESIZE)
    span = (max(nbytes, 1) + align - 1) // align * align
    reserved = mmap.mmap(-1, span + align - mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE)
    address = int(torch.frombuffer(reserved, dtype=torch.uint8).data_ptr())
    start = -address % align
    mapped = _libc.mmap(
        ctypes.c_void_p(address + start),
        ctypes.c_size_t(span),
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_SHARED | _MAP_FIXED,
        fd,
        ctypes.c_long(0),
    )
    if mapped == _MAP_FAILED:
        err = ctypes.get_errno()
        reserved.close()
        raise OSError(err, os.strerror(err))
    return reserved, start, span


def _unmap_client(address: int, span: int) -> None:
    """Fresh anonymous memory (reading zeros, holding no page until written) where `_map_over`
    mapped a client's memfd, so that this process maps the client's pages no more. Should the
    kernel refuse (out of mappings), the memfd stays mapped until the object is freed."""
    _libc.mmap(
        ctypes.c_void_p(address),
        ctypes.c_size_t(span),
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_PRIVATE | _MAP_FIXED | _MAP_ANONYMOUS | _MAP_NORESERVE,
        -1,
        ctypes.c_long(0),
    )


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p


class _End:
    """A buffer's end, run once the object is freed (its finalizer, holding none of it but the
    mmap object of an adopted one's mapping, which therefore lives until then): the descriptor
    closed, the pool told (`on_free`), and where `released`, the client's memfd unmapped from
    under whatever views are left (`_unmap_client`)."""

    def __init__(
        self,
        fd: int,
        buf_id: int,
        on_free: Callable[[int], None] | None,
        client: tuple[mmap.mmap, int, int] | None,
    ) -> None:
        self.fd, self.buf_id, self.on_free = fd, buf_id, on_free
        self.client = client  # an adopted buffer's mapping: its mmap object, address, span
        self.released = False

    def __call__(self) -> None:
        if self.released and self.client is not None:
            _, address, span = self.client
            _unmap_client(address, span)
        self.client = None
        os.close(self.fd)
        if self.on_free is not None:
            self.on_free(self.buf_id)


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

    def get(self, nbytes: int, prefault: bool = True) -> SharedBuffer:
        """A buffer of at least `nbytes`: a released one that fits (its pages faulted in
        already), else a new one (faulted in unless `prefault` is False)."""
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.nbytes <= 2 * nbytes + (1 << 20)]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._free.remove(best)
                return best
        try:
            return SharedBuffer(nbytes, self._on_free, prefault=prefault)
        except OSError as exc:  # out of descriptors (EMFILE, ENFILE) or memory (ENOMEM)
            raise ServiceUnavailableError(
                f"no shared memory for {nbytes} bytes: {exc.strerror or exc}", retry_after=1.0
            ) from exc

    def stage(
        self, tensors: Sequence[torch.Tensor]
    ) -> tuple[SharedBuffer, tuple[torch.Tensor, ...]]:
        """Copies of `tensors`, one after another (cache-line aligned) in one buffer from the
        cache; the buffer and the copies."""
        sizes = [aligned(t.numel() * t.element_size()) for t in tensors]
        buf = self.get(sum(sizes))
        offset, staged = 0, []
        for t, size in zip(tensors, sizes, strict=True):
            dst = buf.tensor(offset, tuple(t.shape), t.dtype)
            dst.copy_(t)
            staged.append(dst)
            offset += size
        return buf, tuple(staged)

    def place(
        self, tensors: Sequence[torch.Tensor], given: Sequence[SharedBuffer]
    ) -> tuple[list[SharedBuffer], tuple[torch.Tensor, ...], SharedBuffer | None]:
        """Each tensor's buffer among `given` where all lie in one of them (read in place);
        else copies of them all in a staged buffer from the cache (returned third)."""
        homes = [next((b for b in given if b.contains(t)), None) for t in tensors]
        if all(home is not None for home in homes):
            return [h for h in homes if h is not None], tuple(tensors), None
        # Inputs from ordinary memory: one copy into shared memory is unavoidable here.
        staging, staged = self.stage(tensors)
        return [staging] * len(tensors), staged, staging

    def outputs(
        self, tq: int, heads: int, v_head_dim: int, dtype: torch.dtype, return_lse: bool
    ) -> tuple[SharedBuffer, torch.Tensor, torch.Tensor | None]:
        """A buffer from the cache holding out `[Tq, H, Dv]` and lse `[H, Tq]` fp32 (or None)."""
        out_bytes = aligned(tq * heads * v_head_dim * dtype.itemsize)
        buf = self.get(out_bytes + (heads * tq * 4 if return_lse else 0))
        out = buf.tensor(0, (tq, heads, v_head_dim), dtype)
        lse = buf.tensor(out_bytes, (heads, tq), torch.float32) if return_lse else None
        return buf, out, lse

    def put(self, buf: SharedBuffer) -> None:
        with self._lock:
            self._free.append(buf)
            while sum(b.nbytes for b in self._free) > self.max_bytes:
                self._free.pop(0)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class WorkerMappings:
    """Which buffers each worker process has mapped, and which of those were freed here since:
    a worker is sent a buffer's descriptor only with the first task naming it, and is told to
    unmap a freed one with its next task. `_lock` guards `_mapped` and `_freed`; the
    dispatcher threads and the buffers' finalizers (any thread) call in."""

    def __init__(self, workers: Iterable[int]) -> None:
        self._mapped: dict[int, set[int]] = {w: set() for w in workers}  # worker id -> buffer ids
        self._freed: set[int] = set()  # freed here, still mapped by some worker
        self._lock = threading.Lock()

    def freed(self, buf_id: int) -> None:
        """`buf_id` was freed in this process (a `SharedBuffer`'s `on_free`)."""
        with self._lock:
            if any(buf_id in m for m in self._mapped.values()):
                self._freed.add(buf_id)

    def plan(
        self, worker: int, buffers: Sequence[SharedBuffer]
    ) -> tuple[tuple[int, ...], list[SharedBuffer]]:
        """What `worker`'s next task carries: buffer ids to forget, buffers to send."""
        with self._lock:
            mapped = self._mapped[worker]
            return tuple(sorted(mapped & self._freed)), [b for b in buffers if b.id not in mapped]

    def sent(self, worker: int, forget: Iterable[int], fresh: Iterable[int]) -> None:
        """A task went out to `worker` with these forgets and fresh buffers."""
        with self._lock:
            mapped = self._mapped[worker]
            mapped.difference_update(forget)
            mapped.update(fresh)
            self._freed -= {i for i in forget if not self._mapped_anywhere(i)}

    def unmapped(self, worker: int, buf_ids: Iterable[int]) -> None:
        """`worker` dropped these mappings (a failed task leaves none of its buffers mapped)."""
        with self._lock:
            self._mapped[worker].difference_update(buf_ids)

    def lost(self, worker: int) -> None:
        """`worker`'s process is gone: it maps nothing."""
        with self._lock:
            self._mapped[worker].clear()
            self._freed = {i for i in self._freed if self._mapped_anywhere(i)}

    def _mapped_anywhere(self, buf_id: int) -> bool:
        return any(buf_id in m for m in self._mapped.values())
