"""Memory for large answers, kept between calls: the results of one call are views of it, and it
is reused once nothing refers to them any more.

Fresh memory costs a page fault per 4 KiB on first touch, and on a VM that is most of the time
an answer takes to arrive (measured on a Zen 5 KVM guest: 64 MiB faulted in 40-50 ms, written
again in 2 ms; a 64 MiB answer read into fresh memory at 1.5 GB/s, into reused memory at 3.8).
An orchestrator asks for answers of the same few sizes layer after layer and drops each once
it has used it, so the memory of one call serves the next.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

__all__ = ["MIN_BYTES", "AnswerMemory"]

MIN_BYTES = 1 << 20  # smaller answers go into ordinary memory
_GRAIN = 2 << 20  # capacities are whole multiples of this, so near sizes share buffers


class AnswerMemory:
    """Buffers for answers of `MIN_BYTES` or more, at most `keep_bytes` of them kept idle.

    `take(n)` gives `n` writable bytes; they go back to the idle ones when the last tensor (or
    view) made over them is collected, in whichever thread that happens."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self, n: int) -> memoryview:
        """`n` bytes (a view of a numpy array that owns a buffer): a reused buffer that fits,
        else a new one."""
        with self._lock:
            fits = [m for m in self._idle if n <= len(m) <= 2 * n + _GRAIN]
            found = min(fits, key=len) if fits else None
            if found is not None:
                self._idle.remove(found)
        buf = found if found is not None else mmap.mmap(-1, -(-n // _GRAIN) * _GRAIN)
        owner = np.frombuffer(buf, dtype=np.uint8, count=n)
        weakref.finalize(owner, self._release, buf)
        return owner.data

    def _release(self, buf: mmap.mmap) -> None:
        with self._lock:
            if self._closed or len(buf) > self.keep_bytes:
                return  # collected with the last reference
            self._idle.append(buf)
            while sum(len(m) for m in self._idle) > self.keep_bytes:
                self._idle.pop(0)  # the longest idle goes first

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(len(m) for m in self._idle)

    def close(self) -> None:
        """Keep nothing from now on; buffers in use stay theirs until collected."""
        with self._lock:
            self._closed = True
            self._idle.clear()
