"""Request bodies in: admission of uploads apart from compute, a budget of bytes in flight, and
reading a body into the pool's shared memory no slower than a minimum rate.

A body being read holds an upload slot (`max_uploads`) and its Content-Length of the byte budget
(`max_inflight_bytes`), never a compute slot: `max_queue` counts only requests whose body is in.
So clients that send slowly can fill the upload slots, not the queue, and are cut off (408) once
they fall below `min_body_rate`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect

from zen_mla import DeadlineExceededError, QueueFullError, RequestTimeoutError, WireFormatError
from zen_mla.engine import PrefillEngine
from zen_mla.pool import SharedBuffer

from .settings import Settings

__all__ = ["Admission", "Ticket", "give_back", "read_body"]

# Buffers up to this size are made and given back on the event loop (~0.1 ms per MiB);
# larger ones in a thread. Giving back (unmapping) there lets the loop run; making one does not
# yet: the pool maps with MAP_POPULATE, and CPython 3.11's mmap() holds the GIL throughout
# (measured: a fresh 1 GiB buffer stalls the loop 0.7-1.5 s here). Buffers the pool's cache
# reuses cost nothing.
SMALL_BYTES = 1 << 20
# A larger body's buffer is made once this fraction of it arrived, so an announced size that
# never comes costs no memory: committed memory stays within 16x the bytes that arrived.
PROOF_FRACTION = 16


@dataclass
class Admission:
    """What the admitted requests hold. Owner: the event loop thread (only coroutines on it
    read or change these counters, so they need no lock)."""

    settings: Settings
    inflight: int = 0  # admitted and not answered: reading, queued or computing
    uploads: int = 0  # bodies being read
    queued: int = 0  # bodies in, queued or computing
    inflight_bytes: int = 0  # Content-Length sum of the admitted requests

    def check_queue(self) -> None:
        if self.queued >= self.settings.max_queue:
            raise QueueFullError(f"{self.queued} requests are queued or running", retry_after=1)

    def admit(self, nbytes: int) -> Ticket:
        """An upload slot and `nbytes` of the budget, or QueueFullError (429)."""
        s = self.settings
        if self.uploads >= s.max_uploads:
            raise QueueFullError(f"{self.uploads} request bodies are being read", retry_after=1)
        if self.inflight_bytes + nbytes > s.max_inflight_bytes:
            raise QueueFullError(
                f"{self.inflight_bytes} bytes of requests are in flight; {nbytes} more would "
                f"pass the {s.max_inflight_bytes} byte budget",
                retry_after=1,
            )
        self.inflight += 1
        self.uploads += 1
        self.inflight_bytes += nbytes
        return Ticket(self, nbytes)


class Ticket:
    """One request's share of `Admission`; `close()` gives back whatever it still holds."""

    def __init__(self, admission: Admission, nbytes: int) -> None:
        self._admission = admission
        self._nbytes = nbytes
        self._uploading = True
        self._queued = False
        self._open = True

    def uploaded(self) -> None:
        if self._uploading:
            self._uploading = False
            self._admission.uploads -= 1

    def enqueue(self) -> None:
        """A compute slot, or QueueFullError (429)."""
        self.uploaded()
        self._admission.check_queue()
        self._queued = True
        self._admission.queued += 1

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        self.uploaded()
        a = self._admission
        if self._queued:
            a.queued -= 1
        a.inflight_bytes -= self._nbytes
        a.inflight -= 1


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


async def read_body(
    receive: Receive,
    nbytes: int,
    engine: PrefillEngine,
    *,
    min_rate: float,
    grace_s: float,
    deadline_at: float,
    deadline_s: float,
    lead: int = 0,
) -> SharedBuffer:
    """The body of `nbytes` (its Content-Length), in a pool buffer the caller releases, from
    byte `lead` on (a caller that knows where the body's tensors start aligns them so).

    After `grace_s`, the bytes in must keep up with `min_rate` bytes/s (counted from the start
    of the read): a body falling behind raises RequestTimeoutError (408). `deadline_at` (loop
    time) raises DeadlineExceededError (504); a vanished client ClientDisconnect; a body longer
    or shorter than announced WireFormatError (400).
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    got = 0
    early: list[bytes] = []  # chunks that came before the buffer was made
    buf: SharedBuffer | None = None
    if nbytes <= SMALL_BYTES:
        buf = engine.buffer(lead + nbytes)
    slow = False
    try:
        async with asyncio.timeout(None) as timer:
            more = True
            while more:
                cut = start + grace_s + got / min_rate if min_rate > 0 else deadline_at
                slow = cut < deadline_at
                timer.reschedule(min(cut, deadline_at))
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                chunk: bytes = message.get("body", b"")
                more = bool(message.get("more_body", False))
                end = got + len(chunk)
                if end > nbytes:
                    raise WireFormatError("body", f"{nbytes} bytes (its Content-Length)", "more")
                if buf is not None:
                    buf.bytes_view[lead + got : lead + end] = chunk
                else:
                    early.append(chunk)
                    if end >= nbytes // PROOF_FRACTION or not more:
                        buf = await asyncio.to_thread(engine.buffer, lead + nbytes)
                        view, at = buf.bytes_view, lead
                        for part in early:
                            view[at : at + len(part)] = part
                            at += len(part)
                        early.clear()
                got = end
    except TimeoutError:
        if buf is not None:
            await give_back(engine, buf)
        if slow:
            elapsed = loop.time() - start
            raise RequestTimeoutError(
                f"the body came slower than {min_rate:.0f} bytes/s after a {grace_s} s grace: "
                f"{got} of {nbytes} bytes in {elapsed:.1f} s"
            ) from None
        raise DeadlineExceededError(f"the body did not arrive within {deadline_s} s") from None
    except BaseException:
        if buf is not None:
            await give_back(engine, buf)
        raise
    if got != nbytes or buf is None:
        if buf is not None:
            await give_back(engine, buf)
        raise WireFormatError("body", f"{nbytes} bytes (its Content-Length)", f"{got} bytes")
    return buf


async def give_back(engine: PrefillEngine, buf: SharedBuffer) -> None:
    """`engine.release(buf)`; for a large buffer in a thread: the release may free an older
    buffer of the pool's cache, and unmapping 1 GiB takes 0.3-0.5 s (without the GIL)."""
    if buf.nbytes <= SMALL_BYTES:
        engine.release(buf)
    else:
        await asyncio.to_thread(engine.release, buf)
