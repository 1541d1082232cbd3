"""Admission: what the requests let in hold (an upload slot while the body is read, a queue
place once it is in, bytes of the budget as they arrive), and each request's share, its
`Ticket`.

A body being read holds an upload slot (`max_uploads`), never a compute slot: `max_queue`
counts only requests whose body is in. With the slots full, a new upload takes the slot of the
slowest upload that has averaged under twice the minimum rate (answered 408): clients that send
nothing, or just above the minimum rate, cannot keep the others out by their number, and an
upload that comes at any real speed is never cut off for another.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from zen_mla import QueueFullError

from .settings import Settings

__all__ = ["Admission", "Ticket"]

# An upload is measured this long before a newcomer may take its slot: long enough for its
# first bytes, which on a working connection come with the head or right after it.
DISPLACE_AFTER_S = 0.05


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

    def admit_read(self, nbytes: int) -> Ticket:
        """A request whose body is in already (a region-socket frame, read by the socket's one
        frame reader): no upload slot to hold, a queue check and its bytes charged now, or
        QueueFullError (429)."""
        self.check_queue()
        ticket = Ticket(self, nbytes)
        self.charge(ticket, nbytes)
        self.inflight += 1
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
        self.timer: asyncio.Timeout | None = None  # the body reader's, while it runs
        self._queued = False
        self._open = True

    def displace(self) -> None:
        """Cut this upload off (its read raises RequestTimeoutError) for a faster one."""
        self.displaced = True
        if self.timer is not None:
            self.timer.reschedule(asyncio.get_running_loop().time())

    def charge(self, nbytes: int) -> None:
        """`nbytes` more of the byte budget, or QueueFullError (429)."""
        self._admission.charge(self, nbytes)

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
