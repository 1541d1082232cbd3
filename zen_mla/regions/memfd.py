"""Anonymous shared memory a client owns: a memfd sealed against shrinking.

The client creates it and hands the descriptor over; the service checks that it is what it
claims before mapping it. The seal is what makes mapping a client's memory safe: a file that
cannot shrink cannot make a reader fault (SIGBUS) past a size checked once.
"""

from __future__ import annotations

import fcntl
import os

from ..errors import InvalidInputError

__all__ = ["check_sealed_memfd", "create_sealed_memfd"]


def create_sealed_memfd(nbytes: int, name: str = "zen-mla-region") -> int:
    """A new memfd of `nbytes` (zero-filled), sealed against shrinking; the caller owns the
    descriptor (close-on-exec)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
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
