"""The one body reader: every HTTP body the service reads (a safetensors `/prefill`, a regions
JSON, a `/v2` infer in JSON or binary, a system shared memory registration) comes in here, with
one admission (`admission`), one minimum rate, one deadline and one byte budget.

- Memory follows the bytes that came: a body's buffer is made without its pages, which are
  faulted in a window ahead of the bytes as they arrive, and the byte budget
  (`max_inflight_bytes`) is charged for what is faulted in, not for what a Content-Length
  announces. A body that would pass the budget is a 429.
- After `body_grace_s`, the bytes in must keep up with `min_body_rate` (408 below); the
  request's deadline bounds the whole read (504).
- A message a transport reads whole (a gRPC call's, `read_message`) shows no progress until it
  is in: it holds its upload slot meanwhile, may be cut off for another once past its grace
  (408) while every slot is taken, and the request's deadline bounds it (504); its bytes are
  charged once it is in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import ClientDisconnect

from zen_mla import DeadlineExceededError, RequestTimeoutError, WireFormatError
from zen_mla.engine import PrefillEngine, SharedBuffer

from .admission import Ticket

__all__ = ["SMALL_BYTES", "Receive", "read_body", "read_message", "release_buffer"]

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
            ticket.timer = timer
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
                    ticket.charge(want - ticket.charged)
                    buf.fault_in(want)
                view[lead + got : lead + end] = chunk
                got = ticket.got = end
    except TimeoutError:
        await release_buffer(engine, buf)
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
        await release_buffer(engine, buf)
        raise
    finally:
        ticket.timer = None
    if got != nbytes:
        await release_buffer(engine, buf)
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


async def release_buffer(engine: PrefillEngine, buf: SharedBuffer) -> None:
    """`engine.release(buf)`; for a large buffer in a thread: the release may free an older
    buffer of the pool's cache, and unmapping 1 GiB takes 0.3-0.5 s (without the GIL)."""
    if buf.nbytes <= SMALL_BYTES:
        engine.release(buf)
    else:
        await asyncio.to_thread(engine.release, buf)
