"""Admission: what the requests let in hold (an upload slot while the body is read, a queue
place once it is in, bytes of the budget for what the service spends on them), each caller's
share of them, and each request's share, its `Ticket`.

A caller (`zen_mla.caller.Caller`) is whom the operator says (`tenants`): the tenant a token
names, else the peer's uid on the region socket, the peer's address on TCP. Shares are
work-conserving: while places are free anyone takes one, so a caller alone may use every slot,
place and byte (the ranks of one orchestrator, often one uid or one address, are not slowed by a
cap meant for strangers). Once they are all taken, a caller holding less than its share (the cap
over the callers holding any, itself counted) takes one more, up to one and a half caps, and a
caller holding nothing takes one all the same, up to a hard ceiling (`Shares`): for slots and
places the cap plus the connection cap (each holds a connection or a socket call, so however
many addresses or tenants hold one, a newcomer gets one), for bytes twice the budget. So a flood
holds the others off no longer than its first places take.

The bytes charged are what the service will hold for a request, not what its caller sends: its
body's bytes as they arrive; before it is queued, the memory its kernel will allocate (padding,
packing and tiles, `PrefillRequest.cost`) and its answer's; the kernel's once the work is done,
the body's once its buffers are back, the answer's once its last byte is sent (`Charge`). A
message a transport reads whole before the service sees its size (gRPC's) is charged the most
that transport may read before it is asked for, and trimmed to its size once it is in.

A body being read holds an upload slot (`max_uploads`), never a compute slot: `max_queue`
counts only requests whose body is in. A small body (`SMALL_BODY` bytes at most: a regions
JSON, a one-token safetensors) holds no slot, so no upload, however many, keeps it waiting. With
the slots full and no share free, a new upload takes the slot of an upload past its grace that
has fallen behind the minimum rate (answered 408), from the caller holding the most: an upload
keeping up with the advertised minimum rate is never cut off for another, nor one in its grace
(what the service has read of a body in its first moments says how busy the service was, not
how fast the caller sends: a 64 MB body sent at once was cut at 0.1 s, 0 bytes read, on a
16-core Intel host under load).

Every gRPC call holds a place among the calls open (`grpc_max_calls`, shared as the others are)
from its start to its handler's end, whatever it reads: each holds a stream's memory in grpc and
a handler here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

from zen_mla import QueueFullError
from zen_mla.caller import Caller

from .settings import Settings

__all__ = [
    "HELD_KINDS",
    "SMALL_BODY",
    "Admission",
    "Charge",
    "Shares",
    "Ticket",
]

# Bytes an upload may lag behind the minimum rate before it counts as fallen behind: a body
# comes in socket-sized bursts, not byte by byte.
DISPLACE_SLACK = 64 << 10
#: bodies up to this size hold no upload slot (their read is bounded by the door's rate and
#: deadline like any other, and the connection cap bounds how many there are)
SMALL_BODY = 16 << 10
#: what the bytes held for requests are: bodies read, kernels' memory, answers not yet sent
HELD_KINDS = ("body", "kernel", "answer", "weight")


class Shares:
    """`cap` units of one thing (upload slots, queue places, bytes), held by callers; never
    more than `ceiling` in all. Past the cap, a caller holding some may grow within its share
    only to `cap * 1.5`: the rest, to the ceiling, is kept for callers holding none."""

    def __init__(self, cap: int, ceiling: int) -> None:
        self.cap = cap
        self.ceiling = ceiling
        self.shared = min(ceiling, cap + cap // 2)
        self.total = 0
        self.held: Counter[Caller | None] = Counter()

    def room(self, caller: Caller | None, n: int = 1) -> bool:
        """May `caller` take `n` more: while the cap allows; past it, when it holds nothing
        (up to the ceiling), or within its share (the cap over the callers holding any)."""
        after = self.total + n
        if after <= self.cap:
            return True
        mine = self.held[caller]
        if mine == 0:
            return after <= self.ceiling
        return after <= self.shared and mine + n <= self.cap // len(self.held)

    def take(self, caller: Caller | None, n: int = 1) -> None:
        self.total += n
        self.held[caller] += n

    def give(self, caller: Caller | None, n: int = 1) -> None:
        self.total -= n
        self.held[caller] -= n
        if self.held[caller] <= 0:
            del self.held[caller]


@dataclass
class Admission:
    """What the admitted requests hold. Owner: the event loop thread (only coroutines on it
    read or change these counters and the set of readers, so they need no lock)."""

    settings: Settings
    inflight: int = 0  # admitted and not answered: reading, queued or computing
    reading: dict[Ticket, None] = field(default_factory=dict)  # bodies holding a slot, in order
    slots: Shares = field(init=False)
    places: Shares = field(init=False)  # bodies in, queued or computing
    bytes: Shares = field(init=False)  # what the service holds for requests (see the module)
    calls: Shares = field(init=False)  # gRPC calls open, from their start to their handler's end
    held_bytes: Counter[str] = field(default_factory=Counter)  # the same, by kind: body, ...

    def __post_init__(self) -> None:
        s = self.settings
        # A caller holding no slot or place gets one while any connection could still ask:
        # every upload and every queued request holds one, and they are capped. The bytes are
        # the memory, held to twice the budget.
        self.slots = Shares(s.max_uploads, s.max_uploads + s.max_connections)
        self.places = Shares(s.max_queue, s.max_queue + s.max_connections)
        self.bytes = Shares(s.max_inflight_bytes, 2 * s.max_inflight_bytes)
        # every gRPC call, whatever it reads: a stream holds grpc's memory and a handler
        self.calls = Shares(s.grpc_max_calls, s.grpc_max_calls + s.max_connections)

    @property
    def uploads(self) -> int:
        return len(self.reading)

    @property
    def queued(self) -> int:
        return self.places.total

    @property
    def inflight_bytes(self) -> int:
        return self.bytes.total

    def check_queue(self, caller: Caller | None = None) -> None:
        """A queue place is free for `caller` now, or QueueFullError (429)."""
        if not self.places.room(caller):
            mine = self.places.held[caller]
            raise QueueFullError(
                f"{self.places.total} requests are queued or running ({mine} of them this "
                "caller's)",
                retry_after=1,
            )

    def admit(self, nbytes: int, caller: Caller | None = None) -> Ticket:
        """The request's share for a body of `nbytes` still to be read: an upload slot unless
        the body is small, or QueueFullError (429)."""
        slot = nbytes > SMALL_BODY
        if slot and not self.slots.room(caller) and not self._displace(caller):
            raise QueueFullError(
                f"{len(self.reading)} request bodies are being read "
                f"({self.slots.held[caller]} of them this caller's)",
                1,
            )
        ticket = Ticket(self, nbytes, caller)
        self.inflight += 1
        if slot:
            self.reading[ticket] = None
            self.slots.take(caller)
        return ticket

    def admit_read(self, nbytes: int, caller: Caller | None = None) -> Ticket:
        """A request whose body is in already (a region-socket frame, read by the socket's one
        frame reader): no upload slot to hold, a queue check and its bytes charged now, or
        QueueFullError (429)."""
        self.check_queue(caller)
        ticket = Ticket(self, nbytes, caller)
        self.charge(ticket, nbytes)
        self.inflight += 1
        return ticket

    def open_call(self, caller: Caller | None) -> None:
        """A place among the gRPC calls open for `caller`'s new call, or QueueFullError (429);
        `close_call` gives it back."""
        if not self.calls.room(caller):
            raise QueueFullError(
                f"{self.calls.total} gRPC calls are open ({self.calls.held[caller]} of them this "
                "caller's)",
                retry_after=1,
            )
        self.calls.take(caller)

    def close_call(self, caller: Caller | None) -> None:
        self.calls.give(caller)

    def _displace(self, caller: Caller | None) -> bool:
        """Cut off an upload past its grace that has fallen behind the minimum rate, of the
        caller holding the most slots, for `caller`'s new one; False if every upload keeps up."""
        rate, grace = self.settings.min_body_rate, self.settings.body_grace_s
        if rate <= 0:
            return False
        now = time.monotonic()
        behind = [
            t
            for t in self.reading
            if not t.displaced
            and now - t.started >= grace
            and t.got + DISPLACE_SLACK < rate * (now - t.started)
        ]
        if not behind:
            return False
        held = self.slots.held
        # the slowest of the caller holding the most (the newcomer's own count as one more)
        victim = max(
            behind,
            key=lambda t: (held[t.caller] + (t.caller == caller), -t.got / (now - t.started)),
        )
        victim.displace()
        return True

    def charge(self, ticket: Ticket, nbytes: int, kind: str = "body") -> None:
        """`nbytes` more of the budget for `ticket`'s `kind` of memory ("body", "kernel",
        "answer"), or QueueFullError (429)."""
        if nbytes <= 0:
            return
        if not self.bytes.room(ticket.caller, nbytes):
            raise QueueFullError(
                f"{self.bytes.total} bytes are held for requests "
                f"({self.bytes.held[ticket.caller]} of them for this caller's); {nbytes} more "
                f"({kind}) would pass the {self.bytes.cap} byte budget",
                retry_after=1,
            )
        self.take(ticket.caller, kind, nbytes)
        ticket.held[kind] += nbytes

    def take(self, caller: Caller | None, kind: str, nbytes: int) -> None:
        self.bytes.take(caller, nbytes)
        self.held_bytes[kind] += nbytes

    def give(self, caller: Caller | None, kind: str, nbytes: int) -> None:
        if nbytes:
            self.bytes.give(caller, nbytes)
            self.held_bytes[kind] -= nbytes


class Ticket:
    """One request's share of `Admission`; `close()` gives back whatever it still holds."""

    def __init__(self, admission: Admission, nbytes: int, caller: Caller | None = None) -> None:
        self._admission = admission
        self.nbytes = nbytes  # as announced
        self.caller = caller
        self.started = time.monotonic()
        self.got = 0  # body bytes in so far
        self.held: Counter[str] = Counter()  # bytes of the budget held, by kind
        self.displaced = False
        self.timer: asyncio.Timeout | None = None  # the body reader's, while it runs
        self._queued = False
        self._open = True

    def displace(self) -> None:
        """Cut this upload off (its read raises RequestTimeoutError) for another. One whose
        read has timed out already (its timer expired, its slot not given back yet: the read
        ends at its next turn) is left to end so."""
        self.displaced = True
        timer = self.timer
        if timer is not None and not timer.expired():
            timer.reschedule(asyncio.get_running_loop().time())

    @property
    def charged(self) -> int:
        """Bytes of the budget held for the body."""
        return self.held["body"]

    def charge(self, nbytes: int, kind: str = "body") -> None:
        """`nbytes` more of the byte budget for `kind`, or QueueFullError (429)."""
        self._admission.charge(self, nbytes, kind)

    def trim(self, nbytes: int, kind: str = "body") -> None:
        """The bytes held for `kind` lowered to `nbytes` (what was held before a size was known,
        once it is), the rest back to the budget."""
        excess = self.held[kind] - nbytes
        if excess > 0:
            self.held[kind] -= excess
            self._admission.give(self.caller, kind, excess)

    def refund(self, kind: str) -> None:
        """The bytes held for `kind` back to the budget."""
        self._admission.give(self.caller, kind, self.held.pop(kind, 0))

    def keep(self, kind: str, as_kind: str | None = None) -> Charge:
        """The bytes held for `kind`, moved out of this ticket into a `Charge` of their own
        (held past the ticket's close: an answer's until its last byte is sent), counted from
        now on as `as_kind` where given (a body kept as a registered weight)."""
        nbytes = self.held.pop(kind, 0)
        if as_kind is not None and as_kind != kind:
            self._admission.held_bytes[kind] -= nbytes
            self._admission.held_bytes[as_kind] += nbytes
            kind = as_kind
        return Charge(self._admission, self.caller, kind, nbytes)

    def uploaded(self) -> None:
        """The body is in (or its read ended): its upload slot, if it held one, is free."""
        a = self._admission
        if self in a.reading:
            del a.reading[self]
            a.slots.give(self.caller)

    def enqueue(self) -> None:
        """A queue place, or QueueFullError (429)."""
        self.uploaded()
        a = self._admission
        a.check_queue(self.caller)
        self._queued = True
        a.places.take(self.caller)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        self.uploaded()
        a = self._admission
        if self._queued:
            a.places.give(self.caller)
        for kind, nbytes in self.held.items():
            a.give(self.caller, kind, nbytes)
        self.held.clear()
        a.inflight -= 1


class Charge:
    """Bytes of the budget held for `caller` apart from any ticket; `close()` gives them back,
    once. Owner: the event loop's thread, as `Admission`'s; `close_soon()` may be called from
    any thread (a buffer's finalizer) and closes it there."""

    def __init__(self, admission: Admission, caller: Caller | None, kind: str, nbytes: int) -> None:
        self._admission = admission
        self.caller = caller
        self.kind = kind
        self.nbytes = nbytes
        self._loop = asyncio.get_running_loop()

    def close(self) -> None:
        nbytes, self.nbytes = self.nbytes, 0
        self._admission.give(self.caller, self.kind, nbytes)

    def close_soon(self) -> None:
        # a closed loop: the service is gone, and its counters with it
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.close)
