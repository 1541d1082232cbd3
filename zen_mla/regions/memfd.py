"""Anonymous shared memory a client owns: a memfd sealed against shrinking, its pages populated.

The client creates it and hands the descriptor over; the service checks that it is what it
claims before mapping it. The seal is what makes mapping a client's memory safe: a file that
cannot shrink cannot make a reader fault (SIGBUS) past a size checked once. That its pages are
populated is what makes it cost its owner: a page a worker faults into a hole would be
allocated by, and charged to, the service (`unpopulated`).
"""

from __future__ import annotations

import fcntl
import mmap
import os

from ..errors import InvalidInputError

__all__ = ["check_populated", "check_sealed_memfd", "create_sealed_memfd", "unpopulated"]

#: `st_blocks` counts 512-byte units on Linux, whatever the file system's block size
_BLOCK = 512
_POPULATE = "a memfd whose pages are all populated (fallocate it, or write it, before registering)"


def create_sealed_memfd(nbytes: int, name: str = "zen-mla-region") -> int:
    """A new memfd of `nbytes` (zero-filled), its pages allocated, sealed against shrinking;
    the caller owns the descriptor (close-on-exec). OSError (ENOSPC, ENOMEM) where the memory
    cannot be had. `posix_fallocate` took 0.27-0.53 s per GiB on a shared Zen 4 host, mostly
    taken off the first writes, which then find their pages allocated (filling a GiB took
    about as long with it as without)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except BaseException:
        os.close(fd)
        raise
    return fd


# F_SEAL_FUTURE_WRITE (Linux 5.1) is not in Python's fcntl before 3.12
_WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


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
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
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
            "Seal it with F_SEAL_SHRINK only",
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


def unpopulated(fd: int, nbytes: int) -> int:
    """How many of the first `nbytes` of memfd `fd` have no memory behind them (holes); 0 when
    its pages hold at least `nbytes`. One `fstat` (1-2 us): the memory a shmem or hugetlb file
    holds (`st_blocks`) counts pages fallocated and not yet written, which `SEEK_HOLE` takes for
    holes (and hugetlbfs answers `SEEK_HOLE` with the end whatever it holds), at no cost per
    page, where `SEEK_HOLE` walks every one (6-22 ms per GiB written). Pages held past the end
    (fallocate with FALLOC_FL_KEEP_SIZE) count too: they are as much the client's memory."""
    return max(0, nbytes - os.fstat(fd).st_blocks * _BLOCK)


def check_populated(fd: int, nbytes: int) -> None:
    """InvalidInputError unless memfd `fd` holds memory for all its `nbytes` (`unpopulated`)."""
    holes = unpopulated(fd, nbytes)
    if holes:
        huge = os.fstat(fd).st_blksize > mmap.PAGESIZE  # hugetlbfs (or shmem's huge pages)
        hint = "A hugetlb memfd's pages come from the free huge pages (vm.nr_hugepages)"
        raise InvalidInputError(
            "region", _POPULATE, f"{holes} of {nbytes} bytes are holes", hint if huge else ""
        )
