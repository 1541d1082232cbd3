"""What every form's answer shares: what it says about its work (`answer_metadata`), the timing
header (`server_timing`), and its bytes from the shared memory the workers wrote (`stream`):
streamed from there without a copy (`Streamed`: read at the door's minimum rate, or cut), the
memory going back to the pool once nothing refers to it, or one plain response when small."""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from zen_mla.attention import KernelChoice

from .forms.base import Computed, RequestRecord
from .pace import Pace

__all__ = [
    "CUT",
    "SEND_CHUNK",
    "SMALL_ANSWER",
    "Streamed",
    "answer_metadata",
    "server_timing",
    "stream",
]

log = logging.getLogger("zen_mla.service")

SEND_CHUNK = 4 << 20  # bytes per write: lets the transport's flow control work
SMALL_ANSWER = 64 << 10  # bytes: an answer this small is sent as one plain response
R = TypeVar("R", bound=Response)
#: the scope's key for the connection's cut (protocol.py): aborts it, unsent bytes dropped
CUT = "zen_mla.cut"


def answer_metadata(kernels: KernelChoice, request_id: str | None = None) -> dict[str, str]:
    """What every answer says about its work, whatever its form: `kernel` (what computed out),
    `lse_kernel` (what computed lse, when asked) and the request's `request_id` (when it gave
    one and the form carries it here: a /v2 answer has its own `id`)."""
    meta = {"kernel": kernels.out}
    if kernels.lse is not None:
        meta["lse_kernel"] = kernels.lse
    if request_id:
        meta["request_id"] = request_id
    return meta


def server_timing(response: R, record: RequestRecord) -> R:
    """The request's ingest, queue and compute times in a Server-Timing header."""
    response.headers["Server-Timing"] = (
        f"ingest;dur={record.ingest_s * 1e3:.3f}, queue;dur={record.queue_s * 1e3:.3f}, "
        f"compute;dur={record.compute_s * 1e3:.3f}"
    )
    return response


def stream(
    head: bytes,
    chunks: Sequence[memoryview],
    result: Computed,
    media_type: str,
    headers: dict[str, str] | None = None,
) -> Response:
    """`head`, then `chunks` (views of the shared memory the workers wrote), without a copy.

    The memory goes back to the pool only when nothing refers to it any more: the transport
    (uvloop) may keep a chunk it could not write at once and send it after the app is done, so
    release waits for the arrays behind the chunks to be collected, not for the last write.
    An answer of `SMALL_ANSWER` bytes or fewer is copied into one plain response and its
    memory released at once: streaming costs a task and a write per part (a 1-token answer
    over TCP: 3-13 % more a call, measured on Zen 5).
    """
    pending = list(chunks)
    length = len(head) + sum(c.nbytes for c in pending)
    if length <= SMALL_ANSWER:
        whole = b"".join([head, *pending])
        result.release()
        return Response(whole, media_type=media_type, headers=headers)
    _release_when_collected(result, [c.obj for c in pending if c.nbytes])
    return Streamed(head, pending, media_type, length, headers)


class Streamed(Response):
    """An answer sent from views of shared memory, a `SEND_CHUNK` at a time, as fast as its
    client reads it, and no slower than its `pace` (the rule bodies keep, set by the pipeline):
    a client that stops reading has its connection cut (aborted: what the transport holds is
    dropped) rather than holding the answer's memory for as long as it keeps the connection
    open."""

    def __init__(
        self,
        head: bytes,
        chunks: list[memoryview],
        media_type: str,
        length: int,
        headers: dict[str, str] | None,
    ) -> None:
        super().__init__(
            None, media_type=media_type, headers={"Content-Length": str(length)} | (headers or {})
        )
        self._parts: list[bytes | memoryview] = [head, *chunks]
        self.length = length
        self.pace = Pace()  # none until the pipeline sets the door's (`Pace.of`)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        loop = asyncio.get_running_loop()
        start, sent = loop.time(), 0
        try:
            async with asyncio.timeout(None) as timer:
                while self._parts:
                    part = self._parts.pop(0)
                    size = part.nbytes if isinstance(part, memoryview) else len(part)
                    for i in range(0, size, SEND_CHUNK):
                        due = self.pace.due(start, sent)
                        if due is not None:
                            timer.reschedule(due)
                        piece = part[i : i + SEND_CHUNK]
                        await send({"type": "http.response.body", "body": piece, "more_body": True})
                        sent += min(SEND_CHUNK, size - i)
                    del part
                timer.reschedule(None)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            self._parts.clear()
            cut: Callable[[], None] | None = scope.get(CUT)
            log.info(
                "an answer was cut: %d of %d bytes read in %.1f s, below %.0f bytes/s",
                sent,
                self.length,
                loop.time() - start,
                self.pace.min_rate,
            )
            if cut is None:  # not under zen-mla's protocol (an in-process test transport)
                raise
            cut()


def _release_when_collected(result: Computed, exporters: list[object]) -> None:
    if not exporters:
        result.release()
        return
    left = [len(exporters)]
    lock = threading.Lock()

    def one_gone() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            result.release()

    for obj in exporters:
        weakref.finalize(obj, one_gone)
