"""What one request holds from its admission to its release, in one owner: its share of the
admission (`Ticket`: an upload slot, a queue place, bytes of the budget by kind) and the
engine's buffers its bytes and its work live in. The body reader takes its buffer from here and
never gives it back; the buffers a form makes as it decodes (a gRPC message's copy, staging)
are handed here with its work (`keep`); the pipeline gives everything back here.
"""

from __future__ import annotations

import asyncio

from zen_mla.engine import PrefillEngine, SharedBuffer

from .admission import Ticket
from .body import SMALL_BYTES

__all__ = ["Held"]


class Held:
    """A request's ticket and buffers. Owner: the request's task; handed whole (`hand_over`)
    to the task that waits out work whose client hung up."""

    def __init__(self, engine: PrefillEngine | None, ticket: Ticket | None = None) -> None:
        self.engine = engine
        self.ticket = ticket
        self.buffers: list[SharedBuffer] = []

    def buffer(self, nbytes: int, *, prefault: bool = True) -> SharedBuffer:
        """A buffer of the engine's, held (and given back) with the request."""
        assert self.engine is not None, "a form that computes nothing takes no buffer"
        buf = self.engine.buffer(nbytes, prefault=prefault)
        self.buffers.append(buf)
        return buf

    def keep(self, buffers: list[SharedBuffer]) -> None:
        """Buffers a form made for the work (its inputs, staging), held from now on."""
        self.buffers.extend(buffers)

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
        """Everything back: the buffers, then the admission."""
        await self.release_buffers()
        if self.ticket is not None:
            self.ticket.close()
            self.ticket = None

    def hand_over(self) -> Held:
        """What is held, in a new owner; this one holds nothing after."""
        kept = Held(self.engine, self.ticket)
        kept.buffers = self.buffers
        self.ticket, self.buffers = None, []
        return kept
