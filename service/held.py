"""What one request holds from its admission to its release, in one owner: its share of the
admission (`Ticket`: an upload slot, a queue place, bytes of the budget by kind), the engine's
buffers its bytes and its work live in, and what its work borrowed (a registered weight's
lease). The body reader takes its buffer from here and never gives it back; the buffers a form
makes as it decodes (a gRPC message's copy, staging) are handed here with its work (`keep`), and
so are its leases (`borrow`); the pipeline gives everything back here. A body kept past the
request (a registered weight) leaves in one step with its charge (`hand_out`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from zen_mla.engine import PrefillEngine, SharedBuffer

from .admission import Charge, Ticket
from .body import SMALL_BYTES

__all__ = ["Held"]


class Held:
    """A request's ticket and buffers. Owner: the request's task; handed whole (`hand_over`)
    to the task that waits out work whose client hung up."""

    def __init__(self, engine: PrefillEngine | None, ticket: Ticket | None = None) -> None:
        self.engine = engine
        self.ticket = ticket
        self.buffers: list[SharedBuffer] = []
        self.leases: list[Callable[[], None]] = []  # each gives back one thing borrowed

    def buffer(self, nbytes: int, *, prefault: bool = True) -> SharedBuffer:
        """A buffer of the engine's, held (and given back) with the request."""
        assert self.engine is not None, "a form that computes nothing takes no buffer"
        buf = self.engine.buffer(nbytes, prefault=prefault)
        self.buffers.append(buf)
        return buf

    def keep(self, buffers: list[SharedBuffer]) -> None:
        """Buffers a form made for the work (its inputs, staging), held from now on."""
        self.buffers.extend(buffers)

    def borrow(self, leases: Iterable[Callable[[], None]]) -> None:
        """What the work borrowed (each call gives one back), held from now on."""
        self.leases.extend(leases)

    def hand_out(self, buf: SharedBuffer, kind: str) -> Charge:
        """`buf` (the body's) and the bytes charged for the body, out of this request into a
        new owner: never given back here, its charge counted as `kind` until the new owner
        closes it."""
        assert self.ticket is not None, "read first"
        self.buffers.remove(buf)
        return self.ticket.keep("body", as_kind=kind)

    async def release_buffers(self) -> None:
        """The buffers back to the engine; a large one in a thread (giving a buffer back may
        unmap an older one of the pool's cache, and unmapping 1 GiB takes 0.3-0.5 s, without the
        GIL)."""
        buffers, self.buffers = self.buffers, []
        for buf in buffers:
            assert self.engine is not None
            if buf.nbytes <= SMALL_BYTES:
                self.engine.release(buf)
            else:
                await asyncio.to_thread(self.engine.release, buf)

    async def release(self) -> None:
        """Everything back: the buffers, what was borrowed, then the admission."""
        await self.release_buffers()
        leases, self.leases = self.leases, []
        for give_back in leases:
            give_back()
        if self.ticket is not None:
            self.ticket.close()
            self.ticket = None

    def hand_over(self) -> Held:
        """What is held, in a new owner; this one holds nothing after."""
        kept = Held(self.engine, self.ticket)
        kept.buffers, kept.leases = self.buffers, self.leases
        self.ticket, self.buffers, self.leases = None, [], []
        return kept
