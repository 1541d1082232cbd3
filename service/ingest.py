"""The one body reader: every HTTP body the service reads (a safetensors `/prefill`, a regions
JSON, a `/v2` infer in JSON or binary, a system shared memory registration) comes in here, with
one admission, one minimum rate, one deadline and one byte budget.

- A body being read holds an upload slot (`max_uploads`), never a compute slot: `max_queue`
  counts only requests whose body is in. With the slots full, a new upload takes the slot of
  the slowest upload that has averaged under twice the minimum rate (answered 408): clients
  that send nothing, or just above the minimum rate, cannot keep the others out by their
  number, and an upload that comes at any real speed is never cut off for another.
- Memory follows the bytes that came: a body's buffer is made without its pages, which are
  faulted in a window ahead of the bytes as they arrive, and the byte budget
  (`max_inflight_bytes`) is charged for what is faulted in, not for what a Content-Length
  announces. A body that would pass the budget is a 429.
- After `body_grace_s`, the bytes in must keep up with `min_body_rate` (408 below); the
  request's deadline bounds the whole read (504).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect

from zen_mla import DeadlineExceededError, QueueFullError, RequestTimeoutError, WireFormatError
from zen_mla.engine import PrefillEngine
from zen_mla.pool import SharedBuffer

from .settings import Settings

__all__ = ["Admission", "Ticket", "give_back", "read_body"]

# Buffers up to this size are given back on the event loop; larger ones in a thread (unmapping
# 1 GiB takes 0.3-0.5 s, without the GIL).
SMALL_BYTES = 1 << 20
# An upload is measured this long before a newcomer may take its slot: long enough for its
# first bytes, which on a working connection come with the head or right after it.
DISPLACE_AFTER_S = 0.05
# Bytes of a body faulted in (and charged to the budget) ahead of the bytes that came: faulting
# a window in one madvise is far cheaper than a fault per page, and 16 MiB takes ~2 ms.
WINDOW = 16 << 20


@dataclass
class Admission:
    """What the admitted requests hold. Owner: the event loop thread (only coroutines on it
    read or change these counters and the set of readers, so they need no lock)."""

    settings: Settings
    inflight: int = 0  # admitted and not answered: reading, queued or computing
    queued: int = 0  # bodies in, queued or computing
    inflight_bytes: int = 0  # body bytes held in memory: faulted in while read, whole once in
    reading: dict[Ticket, None] = field(default_factory=dict)  # bodies being read, in order

    @property
    def uploads(self) -> int:
        return len(self.reading)

    def check_queue(self) -> None:
        if self.queued >= self.settings.max_queue:
            raise QueueFullError(f"{self.queued} requests are queued or running", retry_after=1)

    def admit(self, nbytes: int) -> Ticket:
        """An upload slot for a body of `nbytes`, or QueueFullError (429)."""
        s = self.settings
        if len(self.reading) >= s.max_uploads and not self._displace_slowest():
            raise QueueFullError(f"{len(self.reading)} request bodies are being read", 1)
        ticket = Ticket(self, nbytes)
        self.inflight += 1
        self.reading[ticket] = None
        return ticket

    def _displace_slowest(self) -> bool:
        """Cut off the slowest upload, if one has averaged under twice the minimum rate (at
        least 1 MB/s), for a new one."""
        now = time.monotonic()
        floor = 2 * max(self.settings.min_body_rate, 1e6)
        rates = {
            t: t.got / (now - t.started)
            for t in self.reading
            if now - t.started >= DISPLACE_AFTER_S and not t.displaced
        }
        slow = [t for t, rate in rates.items() if rate < floor]
        if not slow:
            return False
        min(slow, key=rates.__getitem__).displace()
        return True

    def charge(self, ticket: Ticket, nbytes: int) -> None:
        """`nbytes` more of the budget for `ticket`, or QueueFullError (429)."""
        budget = self.settings.max_inflight_bytes
        if self.inflight_bytes + nbytes > budget:
            raise QueueFullError(
                f"{self.inflight_bytes} bytes of request bodies are held; {nbytes} more would "
                f"pass the {budget} byte budget",
                retry_after=1,
            )
        self.inflight_bytes += nbytes
        ticket.charged += nbytes


class Ticket:
    """One request's share of `Admission`; `close()` gives back whatever it still holds."""

    def __init__(self, admission: Admission, nbytes: int) -> None:
        self._admission = admission
        self.nbytes = nbytes  # as announced
        self.started = time.monotonic()
        self.got = 0  # body bytes in so far
        self.charged = 0  # bytes of the budget held
        self.displaced = False
        self._timer: asyncio.Timeout | None = None  # the read's, while it runs
        self._queued = False
        self._open = True

    def displace(self) -> None:
        """Cut this upload off (its read raises RequestTimeoutError) for a faster one."""
        self.displaced = True
        if self._timer is not None:
            self._timer.reschedule(asyncio.get_running_loop().time())

    def uploaded(self) -> None:
        self._admission.reading.pop(self, None)

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
        a.inflight_bytes -= self.charged
        self.charged = 0
        a.inflight -= 1


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


async def read_body(
    receive: Receive,
    ticket: Ticket,
    engine: PrefillEngine,
    *,
    min_rate: float,
    grace_s: float,
    deadline_at: float,
    deadline_s: float,
    lead: int = 0,
) -> SharedBuffer:
    """The body of `ticket.nbytes` (its Content-Length), in a pool buffer the caller releases,
    from byte `lead` on (a caller that knows where the body's tensors start aligns them so).

    After `grace_s`, the bytes in must keep up with `min_rate` bytes/s (counted from the start
    of the read): a body falling behind, or displaced by a faster one, raises
    RequestTimeoutError (408). `deadline_at` (loop time) raises DeadlineExceededError (504); a
    vanished client ClientDisconnect; a body longer or shorter than announced WireFormatError
    (400); the byte budget QueueFullError (429).
    """
    nbytes = ticket.nbytes
    loop = asyncio.get_running_loop()
    start = loop.time()
    total = lead + nbytes
    # No pages yet: they are faulted in (and charged) a window ahead of the bytes that came.
    buf = engine.buffer(total, prefault=False)
    view = buf.bytes_view
    got = 0
    slow = False
    try:
        async with asyncio.timeout(None) as timer:
            ticket._timer = timer
            more = True
            while more:
                if ticket.displaced:
                    raise TimeoutError
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
                if lead + end > ticket.charged:  # the next window, in one step
                    want = min(total, lead + end + WINDOW)
                    ticket._admission.charge(ticket, want - ticket.charged)
                    buf.fault_in(want)
                view[lead + got : lead + end] = chunk
                got = ticket.got = end
    except TimeoutError:
        await give_back(engine, buf)
        elapsed = loop.time() - start
        if ticket.displaced:
            raise RequestTimeoutError(
                f"the body was cut off for a faster one while every upload slot was taken: "
                f"{got} of {nbytes} bytes in {elapsed:.1f} s"
            ) from None
        if slow:
            raise RequestTimeoutError(
                f"the body came slower than {min_rate:.0f} bytes/s after a {grace_s} s grace: "
                f"{got} of {nbytes} bytes in {elapsed:.1f} s"
            ) from None
        raise DeadlineExceededError(f"the body did not arrive within {deadline_s} s") from None
    except BaseException:
        await give_back(engine, buf)
        raise
    finally:
        ticket._timer = None
    if got != nbytes:
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
