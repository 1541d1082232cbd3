"""Anonymous shared memory a client owns: a memfd sealed against shrinking, its pages populated.

The client creates it and hands the descriptor over; the service checks that it is what it
claims before mapping it. The seal is what makes mapping a client's memory safe: a file that
cannot shrink cannot make a reader fault (SIGBUS) past a size checked once. That its pages are
populated is what makes it cost its owner: a page a worker faults into a hole would be
allocated by, and charged to, the service (`unpopulated`). Only pages inside the region count:
the service seals it against growing as it takes it (`seal_against_growth`), so no page can come
to lie past its end, and refuses one that holds pages there already (`check_populated`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os

from ..errors import InvalidInputError

__all__ = [
    "charged_bytes",
    "check_populated",
    "check_sealed_memfd",
    "create_sealed_memfd",
    "held_past_end",
    "seal_against_growth",
    "unpopulated",
    "writable",
]

#: `st_blocks` counts 512-byte units on Linux, whatever the file system's block size
_BLOCK = 512
_POPULATE = "a memfd whose pages are all populated (fallocate it, or write it, before registering)"
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def create_sealed_memfd(nbytes: int, name: str = "zen-mla-region") -> int:
    """A new memfd of `nbytes` (zero-filled), its pages allocated, sealed against shrinking and
    growing; the caller owns the descriptor (close-on-exec). OSError (ENOSPC, ENOMEM) where the
    memory cannot be had. `posix_fallocate` took 0.27-0.53 s per GiB on a shared Zen 4 host,
    mostly taken off the first writes, which then find their pages allocated (filling a GiB
    took about as long with it as without)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


# F_SEAL_FUTURE_WRITE (Linux 5.1) is not in Python's fcntl before 3.12
_WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def _seals(fd: int) -> int:
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return 0


def check_sealed_memfd(fd: int) -> int:
    """The size of `fd` if it is a memfd of at least one byte, open read-write, sealed against
    shrinking and not against writing (the workers write outputs into it), else
    InvalidInputError naming what it is instead."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = "?"
    if not target.startswith("/memfd:"):
        raise InvalidInputError(
            "region", "a memfd (os.memfd_create) sealed with F_SEAL_SHRINK", f"'{target}'"
        )
    seals = _seals(fd)
    if not seals & fcntl.F_SEAL_SHRINK:
        raise InvalidInputError(
            "region",
            "a memfd sealed with F_SEAL_SHRINK",
            "a memfd that can shrink",
            "Create it with MFD_ALLOW_SEALING and add F_SEAL_SHRINK before handing it over",
        )
    if seals & _WRITE_SEALS:
        raise InvalidInputError(
            "region",
            "a memfd the service may write (outputs land in it)",
            "a memfd sealed against writing",
            "Seal it with F_SEAL_SHRINK (and F_SEAL_GROW) only",
        )
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise InvalidInputError(
            "region",
            "a descriptor open read-write",
            "one open read-only or write-only",
            "Hand over the descriptor memfd_create returned, not one reopened",
        )
    nbytes = os.fstat(fd).st_size
    if nbytes == 0:
        raise InvalidInputError("region", "a memfd of at least 1 byte", "0 bytes")
    return nbytes


def writable(fd: int) -> bool:
    """Memfd `fd` is not sealed against writing: a worker can still map it to write outputs
    (F_SEAL_FUTURE_WRITE, which a client may add at any time, makes that mmap fail, EPERM).
    One `fcntl` (~0.5 us)."""
    return not _seals(fd) & _WRITE_SEALS


def seal_against_growth(fd: int) -> None:
    """Seal memfd `fd` against growing, where its client has not: a region's size is fixed once
    it is registered, and a file that cannot grow cannot be given pages past its end either
    (fallocate with FALLOC_FL_KEEP_SIZE beyond it fails, EPERM), which `st_blocks` would count
    as the region's. InvalidInputError where its seals are sealed (F_SEAL_SEAL) without it."""
    if _seals(fd) & fcntl.F_SEAL_GROW:
        return
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
    except PermissionError:
        raise InvalidInputError(
            "region",
            "a memfd sealed with F_SEAL_GROW, or one the service may seal so",
            "a memfd that can grow, its seals sealed (F_SEAL_SEAL)",
            "Add F_SEAL_GROW with F_SEAL_SHRINK, or leave F_SEAL_SEAL off",
        ) from None


def _granule(fd: int) -> int:
    """The unit a mapping of memfd `fd` faults pages in by: a page, or a huge page (a hugetlb
    memfd, or shmem's huge pages)."""
    return max(mmap.PAGESIZE, os.fstat(fd).st_blksize)


def charged_bytes(fd: int, nbytes: int) -> int:
    """What a region of the first `nbytes` of memfd `fd` is charged to its owner: all a worker
    mapping it can fault in, whole pages (`_granule`)."""
    unit = _granule(fd)
    return -(-nbytes // unit) * unit


def unpopulated(fd: int, nbytes: int) -> int:
    """How many of the first `nbytes` of memfd `fd` have no memory behind them (holes); 0 when
    its pages hold at least `nbytes`, where it holds none past its end (sealed against growing,
    `seal_against_growth`, and checked once, `check_populated`). One `fstat` (1-2 us): the
    memory a shmem or hugetlb file holds (`st_blocks`) counts pages fallocated and not yet
    written, which `SEEK_HOLE` takes for holes (and hugetlbfs answers `SEEK_HOLE` with the end
    whatever it holds), at no cost per page, where `SEEK_HOLE` walks every one (6-22 ms per GiB
    written)."""
    return max(0, nbytes - os.fstat(fd).st_blocks * _BLOCK)


def held_past_end(fd: int, nbytes: int) -> int:
    """Bytes of the pages memfd `fd` holds past its first `nbytes` (rounded up to whole
    `_granule`s): fallocated with FALLOC_FL_KEEP_SIZE, they are in `st_blocks` but no part of
    the region. Through `cachestat` (Linux 6.5), whose walk costs per page held there (~2.5 us
    for a memfd made as `create_sealed_memfd` makes one, none there). Where it cannot say (an
    older kernel, a seccomp filter, a hugetlb memfd), only what `st_blocks` holds beyond the
    region's size can be told: pages past the end that make up for as many holes inside pass."""
    end = charged_bytes(fd, nbytes)
    try:
        return _cached_bytes(fd, end)
    except OSError as exc:
        if exc.errno not in _CANNOT_SAY:
            raise
        return max(0, os.fstat(fd).st_blocks * _BLOCK - end)


def check_populated(fd: int, nbytes: int) -> None:
    """InvalidInputError unless memfd `fd` holds memory for all its `nbytes` (`unpopulated`)
    and none past them (`held_past_end`): what registration checks, once the memfd is sealed
    against growing."""
    past = held_past_end(fd, nbytes)
    if past:
        raise InvalidInputError(
            "region",
            "a memfd whose pages all lie inside its size",
            f"{past} bytes of pages past its {nbytes} bytes",
            "Allocate it with fallocate without FALLOC_FL_KEEP_SIZE (or posix_fallocate)",
        )
    holes = unpopulated(fd, nbytes)
    if holes:
        huge = os.fstat(fd).st_blksize > mmap.PAGESIZE  # hugetlbfs (or shmem's huge pages)
        hint = "A hugetlb memfd's pages come from the free huge pages (vm.nr_hugepages)"
        raise InvalidInputError(
            "region", _POPULATE, f"{holes} of {nbytes} bytes are holes", hint if huge else ""
        )


class _CacheStatRange(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _CacheStat(ctypes.Structure):
    _fields_ = tuple(
        (n, ctypes.c_uint64)
        for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    )


_libc = ctypes.CDLL(None, use_errno=True)
_SYS_CACHESTAT = 451  # <asm/unistd.h>: the same number on every architecture
#: cachestat's errors where it cannot say: no such call (before Linux 6.5), one a seccomp filter
#: refuses (a container's default profile may), a file system it does not walk (hugetlbfs)
_CANNOT_SAY = (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP)


def _cached_bytes(fd: int, start: int) -> int:
    """Bytes of the pages file `fd` holds from `start` to its last (in memory or swapped out,
    written or only fallocated); OSError where the kernel cannot say."""
    where, stat = _CacheStatRange(start, 0), _CacheStat()  # len 0: to the file's last page
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(where), ctypes.byref(stat), 0):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(stat.nr_cache + stat.nr_evicted) * mmap.PAGESIZE
