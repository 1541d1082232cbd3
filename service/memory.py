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

Both do nothing where the C library has neither call (not glibc)."""

from __future__ import annotations

import asyncio
import ctypes
from typing import Any

__all__ = ["TRIM_BYTES", "TRIM_DELAY_S", "Trim", "map_large_allocations"]

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
