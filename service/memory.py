"""The C library's allocator as the service process sets it up: memory a large message held goes
back to the system once the message is let go, not kept resident by glibc for later.

- `map_large_allocations`: blocks of 32 MiB and more get mappings of their own (glibc's mallopt
  M_MMAP_THRESHOLD, fixed), unmapped when freed. By default glibc raises the threshold to the
  largest such block freed, and blocks below it come from the heap and stay resident after
  they are freed (seen: 2.8-3.4 GiB still held after six 200 MiB gRPC messages). Fixed at glibc's
  own ceiling, 32 MiB: a lower one maps and faults in every answer and message of a few MiB
  anew (at 1 MiB, `bench/e2e.py`'s v2 and gRPC routes took 1.3-2.3x their time on `mixed` and
  `short`), and what the heap keeps below it the trim gives back.
- `Trim`: the heap trimmed (malloc_trim) once large gRPC messages stop coming. grpc's Python
  layer builds a message's bytes by growing a bytearray, which glibc grows in place on the heap
  (a heap block that grows is never moved to a mapping of its own), and the heap cannot shrink
  below a small block allocated above it meanwhile (seen: 378 MiB kept after six 200 MiB
  messages, the threshold fixed).

- `exec_with_huge_pages`: the service process started again with glibc's tunable
  `glibc.malloc.hugetlb=1`, so those mappings are backed by transparent huge pages: a 64 MiB
  message is faulted in as 32 pages, not 16,384 (measured by `bench/e2e.py`: the gRPC routes
  took 1.2-1.6x their time with 4 KiB pages, the v2 binary route up to 1.25x).

All do nothing where the C library is not glibc."""

from __future__ import annotations

import asyncio
import ctypes
import os
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "HUGE_PAGES",
    "TRIM_BYTES",
    "TRIM_DELAY_S",
    "Trim",
    "exec_with_huge_pages",
    "map_large_allocations",
]

# glibc's mallopt parameter: the size from which a block is mapped on its own
M_MMAP_THRESHOLD = -3
#: a message at least this large is followed by a trim
TRIM_BYTES = 16 << 20
#: seconds after the last such message the trim waits for
TRIM_DELAY_S = 0.5


def _libc_call(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


#: glibc's tunable for transparent huge pages under malloc's own mappings (glibc 2.35 and later;
#: an older one ignores it)
HUGE_PAGES = "glibc.malloc.hugetlb=1"
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def exec_with_huge_pages() -> None:
    """This process started again in place (`exec`: the same pid, the same argv) with
    `HUGE_PAGES` among its GLIBC_TUNABLES, which glibc reads only when a process starts. Nothing
    where GLIBC_TUNABLES names `glibc.malloc.hugetlb` already (the operator's choice, or the
    second start), where the C library is not glibc, or where the system has transparent huge
    pages off. Call it first, before threads or anything worth keeping exist."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables or not _glibc():
        return
    try:
        if "[never]" in _THP.read_text():
            return
    except OSError:
        return  # no transparent huge pages here
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES
    os.execv(sys.executable, sys.orig_argv)


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


def map_large_allocations(threshold: int = 32 << 20) -> None:
    """Blocks of `threshold` bytes and more mapped on their own, for this process's life."""
    mallopt = _libc_call("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, threshold)


class Trim:
    """The heap's free pages handed back to the system once large messages stop coming: a trim
    `TRIM_DELAY_S` after the last message of `TRIM_BYTES` or more was let go, one at a time, in
    a thread (ctypes lets the GIL go; malloc_trim takes the allocator's own locks). A burst of
    messages reuses the heap's pages meanwhile: a trim after each one faulted them in again for
    the next (`bench/e2e.py`'s gRPC route took 1.2-1.8x its time on `mixed` and `short`).
    Owner: the event loop's thread."""

    def __init__(self) -> None:
        self._trim = _libc_call("malloc_trim")
        self._timer: asyncio.TimerHandle | None = None
        self._running: asyncio.Future[Any] | None = None

    def after(self, nbytes: int) -> None:
        """A message of `nbytes` was let go: a trim `TRIM_DELAY_S` from now, unless it is small
        (one due already is put off)."""
        if nbytes < TRIM_BYTES or self._trim is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._start)

    def _start(self) -> None:
        self._timer = None
        if self._running is not None and not self._running.done():
            self._timer = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._start)
            return
        self._running = asyncio.ensure_future(asyncio.to_thread(self._trim, 0))
