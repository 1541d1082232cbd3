"""The one body reader: every HTTP body the service reads (a safetensors `/prefill`, a regions
JSON, a `/v2` infer in JSON or binary, a system shared memory registration) comes in here, with
one admission (`admission`), one minimum rate, one deadline and one byte budget.

- Memory follows the bytes that came: a body's buffer is made without its pages, which are
  faulted in a window ahead of the bytes as they arrive, and the byte budget
  (`max_inflight_bytes`) is charged for what is faulted in, not for what a Content-Length
  announces. A body that would pass the budget is a 429.
- After `body_grace_s`, the bytes in must keep up with `min_body_rate` (`pace`: 408 below);
  the request's deadline bounds the whole read (504).
- The body's buffer is the request's (`held`): taken from there, given back by the pipeline
  with everything else the request holds, however the read ends.
- A message a transport reads whole (a gRPC call's, `read_message`) shows no progress until it
  is in: it holds its upload slot meanwhile, may be cut off for another once past its grace
  (408) while every slot is taken, and the request's deadline bounds it (504); its bytes are
  charged once it is in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect

from zen_mla import DeadlineExceededError, RequestTimeoutError, WireFormatError
from zen_mla.engine import SharedBuffer

from .admission import Ticket
from .pace import Pace

if TYPE_CHECKING:
    from .held import Held

__all__ = ["SMALL_BYTES", "Receive", "read_body", "read_message"]

#: Work on this many bytes or fewer is done on the event loop, more in a thread (where the GIL
#: is let go or the loop must not wait): giving a buffer back (unmapping 1 GiB takes 0.3-0.5 s),
#: making a job's `out` (the pool pre-faults it), parsing a /v2 JSON (its Python objects take
#: some ten times its bytes), writing an output into system shared memory (pwrite).
SMALL_BYTES = 1 << 20
# Bytes of a body faulted in (and charged to the budget) ahead of the bytes that came: faulting
# a window in one madvise is far cheaper than a fault per page, and 16 MiB takes ~2 ms.
WINDOW = 16 << 20

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


async def read_body(
    receive: Receive,
    held: Held,
    pace: Pace,
    *,
    deadline_at: float,
    deadline_s: float,
    lead: int = 0,
) -> SharedBuffer:
    """The body of `held.ticket.nbytes` (its Content-Length), in a buffer `held` owns, from byte
    `lead` on (a caller that knows where the body's tensors start aligns them so).

    After the grace, the bytes in must keep up with `pace` (counted from the start of the read):
    a body falling behind, or displaced by a faster one, raises RequestTimeoutError (408).
    `deadline_at` (loop time) raises DeadlineExceededError (504); a vanished client
    ClientDisconnect; a body longer or shorter than announced WireFormatError (400); the byte
    budget QueueFullError (429).
    """
    ticket = held.ticket
    assert ticket is not None, "admitted first"
    nbytes = ticket.nbytes
    loop = asyncio.get_running_loop()
    start = loop.time()
    total = lead + nbytes
    # No pages yet: they are faulted in (and charged) a window ahead of the bytes that came.
    buf = held.buffer(total, prefault=False)
    view = buf.bytes_view
    got = 0
    slow = False
    try:
        async with asyncio.timeout(None) as timer:
            ticket.timer = timer
            more = True
            while more:
                if ticket.displaced:
                    raise TimeoutError
                due = pace.due(start, got)
                slow = due is not None and due < deadline_at
                timer.reschedule(due if due is not None and slow else deadline_at)
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
                    ticket.charge(want - ticket.charged)
                    buf.fault_in(want)
                view[lead + got : lead + end] = chunk
                got = ticket.got = end
    except TimeoutError:
        elapsed = loop.time() - start
        if ticket.displaced:
            raise RequestTimeoutError(
                f"the body was cut off for a faster one while every upload slot was taken: "
                f"{got} of {nbytes} bytes in {elapsed:.1f} s"
            ) from None
        if slow:
            raise RequestTimeoutError(
                f"the body came slower than {pace.min_rate:.0f} bytes/s after a {pace.grace_s} s "
                f"grace: {got} of {nbytes} bytes in {elapsed:.1f} s"
            ) from None
        raise DeadlineExceededError(f"the body did not arrive within {deadline_s} s") from None
    finally:
        ticket.timer = None
    if got != nbytes:
        raise WireFormatError("body", f"{nbytes} bytes (its Content-Length)", f"{got} bytes")
    return buf


async def read_message(
    message: Callable[[], Awaitable[bytes]],
    ticket: Ticket,
    *,
    deadline_at: float,
    deadline_s: float,
) -> bytes:
    """The message `message()` awaits, for `ticket` (admitted, holding an upload slot), by
    loop time `deadline_at` (DeadlineExceededError after); cut off for another upload (`Ticket.
    displace`, RequestTimeoutError) as an HTTP body that shows no progress would be."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout_at(deadline_at) as timer:
            ticket.timer = timer
            if ticket.displaced:
                raise TimeoutError
            return await message()
    except TimeoutError:
        if ticket.displaced:
            raise RequestTimeoutError(
                "the message was cut off for another while every upload slot was taken: not in "
                f"after {loop.time() - start:.1f} s"
            ) from None
        raise DeadlineExceededError(f"the message did not arrive within {deadline_s} s") from None
    finally:
        ticket.timer = None
