"""What every compute route shares, whatever its wire format (`/prefill`, `/v2/.../infer`): the
gate (`state.readiness`, the token), admission before a body byte is read, the body through the one
reader, the wait on the engine within the deadline while watching the client, the log line and
metrics of each request, and responses streamed from the shared memory the workers wrote."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from zen_mla import (
    BodyTooLargeError,
    KernelError,
    LengthRequiredError,
    UnauthorizedError,
    ZenMLAError,
    status_of,
)
from zen_mla.attention import KernelChoice
from zen_mla.engine import PrefillEngine, PrefillJob, PrefillRequest, PrefillResult
from zen_mla.pool import SharedBuffer

from .admission import Ticket, client_of
from .body import SMALL_BYTES, give_back, read_body
from .state import ServiceState, readiness

__all__ = [
    "ClientGoneError",
    "Exchange",
    "admit",
    "answer_metadata",
    "authorize",
    "byte_count",
    "compute",
    "content_length",
    "disconnected",
    "drop_body",
    "gate",
    "handle",
    "ready_engine",
    "receive",
    "receive_small",
    "timed",
]

log = logging.getLogger("zen_mla.service")
R = TypeVar("R", bound=Response)


def authorize(state: ServiceState, request: Request) -> None:
    """The bearer token, where one is set."""
    s = state.settings
    if s.api_token is not None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        good = s.api_token.get_secret_value().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), good):
            raise UnauthorizedError("a valid bearer token is required (Authorization: Bearer ...)")


def ready_engine(state: ServiceState) -> PrefillEngine:
    """The engine, while the service admits compute requests (`readiness`); else its 503."""
    now = readiness(state)
    if not now.admitting or state.engine is None:
        raise now.error(retry_after=5)
    return state.engine


def gate(state: ServiceState, request: Request) -> PrefillEngine:
    """Checks every compute request passes first: admitting (`ready_engine`), the token."""
    engine = ready_engine(state)
    authorize(state, request)
    return engine


def byte_count(raw: str) -> int | None:
    """A header's byte count: ASCII digits only (str.isdigit() takes "²" and int() 5,000
    digits, both costly or fatal later), at most 18 of them; None otherwise."""
    raw = raw.strip()
    if not (0 < len(raw) <= 18 and raw.isascii() and raw.isdigit()):
        return None
    return int(raw)


def content_length(request: Request) -> int:
    raw = request.headers.get("content-length")
    n = None if raw is None else byte_count(raw)
    if n is None:
        got = "none" if raw is None else repr(raw[:40])
        raise LengthRequiredError(f"Content-Length: expected the body size in bytes, got {got}")
    return n


def admit(state: ServiceState, request: Request, limit: int) -> Ticket:
    """Checks made before a byte of the body is read; the request's share of the admission,
    counted to its client (the peer's address)."""
    n = content_length(request)
    if n > limit:
        raise BodyTooLargeError(f"Content-Length: expected at most {limit} bytes, got {n}")
    client = client_of(request.client.host if request.client is not None else None)
    state.admission.check_queue(client)  # a full queue now is a 429 now, not after the upload
    return state.admission.admit(n, client)


async def receive(
    state: ServiceState, request: Request, engine: PrefillEngine, x: Exchange, lead: int = 0
) -> SharedBuffer:
    """The admitted body (`x.ticket`'s Content-Length) in a pool buffer from byte `lead` on,
    through the one body reader (`body.read_body`: its rate, deadline and byte budget); it is
    `x.buf` from then on."""
    s = state.settings
    assert x.ticket is not None, "admit() first"
    loop = asyncio.get_running_loop()
    x.buf = await read_body(
        request.receive,
        x.ticket,
        engine,
        min_rate=s.min_body_rate,
        grace_s=s.body_grace_s,
        deadline_at=loop.time() + x.remaining(s.deadline_s),
        deadline_s=s.deadline_s,
        lead=lead,
    )
    x.bytes_in = x.ticket.nbytes
    x.ticket.uploaded()
    return x.buf


async def receive_small(
    state: ServiceState, request: Request, engine: PrefillEngine, x: Exchange, limit: int
) -> bytes:
    """A small body (a regions JSON, a registration), admitted and read through the one body
    reader like any other, as bytes; its buffer goes back at once."""
    x.ticket = admit(state, request, limit)
    buf = await receive(state, request, engine, x)
    try:
        return bytes(buf.bytes_view[: x.bytes_in])
    finally:
        await drop_body(engine, x)


async def drop_body(engine: PrefillEngine, x: Exchange) -> None:
    """The body's buffer (and any staging the work read) back to the pool once the work is
    done (before the answer is sent)."""
    held, x.buf, x.staging = [*([x.buf] if x.buf is not None else []), *x.staging], None, []
    for buf in held:
        await give_back(engine, buf)


async def disconnected(request: Request) -> None:
    """Returns once the HTTP client hangs up (what `compute` watches for an HTTP request)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGoneError(Exception):
    """The client closed the connection while its work ran (answered 499, for metrics)."""


@dataclass
class Exchange:
    """One compute request as the log line and the metrics see it."""

    route: str
    t0: float = field(default_factory=time.perf_counter)
    request_id: str | None = None
    status: int = 500
    bytes_in: int = 0
    bytes_out: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    buf: SharedBuffer | None = None  # the body's buffer, until handed back
    staging: list[SharedBuffer] = field(default_factory=list)  # more buffers the work reads
    ticket: Ticket | None = None

    def remaining(self, deadline_s: float) -> float:
        return deadline_s - (time.perf_counter() - self.t0)


A = TypeVar("A")
ErrorAnswer = Callable[[ZenMLAError, "Exchange", dict[str, str] | None], A]


async def handle(
    state: ServiceState,
    route: str,
    work: Callable[[Exchange], Awaitable[A]],
    answer_error: ErrorAnswer[A],
    hung_up: Callable[[], A] | None = None,
) -> A:
    """One compute request from start to log line: `work` answers it (an HTTP response, or a
    region-socket reply); a zen_mla error is answered by `answer_error` in the route's form,
    anything else as a 500 of the same form; a client gone is a 499 (`hung_up`'s answer, which
    nobody reads; in the metrics only). The body's buffer and the admission are given back
    whatever happened."""
    x = Exchange(route)
    try:
        return await work(x)
    except (ClientDisconnect, ClientGoneError):
        x.status = 499
        return hung_up() if hung_up is not None else cast(A, Response(status_code=499))
    except ZenMLAError as exc:
        x.status = status_of(exc)
        # Answered before the whole body came: the connection closes (lingering, see
        # protocol.py) rather than reading an unbounded rest of the body to keep it alive.
        return answer_error(exc, x, None if x.bytes_in else {"Connection": "close"})
    except Exception as exc:  # a bug of ours: a 500, never a dropped connection
        log.exception("%s failed", route)
        x.status = 500
        return answer_error(KernelError(f"internal error: {type(exc).__name__}: {exc}"), x, None)
    finally:
        if state.engine is not None:
            await drop_body(state.engine, x)
        if x.ticket is not None:
            x.ticket.close()
        total = time.perf_counter() - x.t0
        state.metrics.observe("total", total)
        state.metrics.count_request(route, x.status, x.bytes_in, x.bytes_out)
        if log.isEnabledFor(logging.INFO):  # no JSON built for a line not logged (~3 us)
            log.info(
                json.dumps(
                    {
                        "event": route,
                        "request_id": x.request_id,
                        "status": x.status,
                        "bytes_in": x.bytes_in,
                        "bytes_out": x.bytes_out,
                        "total_ms": round(total * 1e3, 3),
                        **x.info,
                    }
                )
            )


async def compute(
    state: ServiceState,
    gone: Awaitable[None],
    prepared: PrefillRequest,
    run: Callable[..., PrefillJob],
    x: Exchange,
) -> tuple[PrefillResult, tuple[float, float]]:
    """Queue the prepared request (`run(loop=)`: `PrefillEngine.run` with its request bound)
    and wait for it within the deadline, watching the client (`gone` completes when it hangs
    up: `disconnected(request)` for HTTP, the region socket's own for a socket call; it is
    cancelled once the work is done; a hang-up while the job's worker holds its reply does not
    count, see `PrefillJob.replying`); the result, and its (queue, compute) seconds. A small
    request is run from this thread (`loop=`): one small enough for one worker goes straight
    to an idle one, with no thread between."""
    s = state.settings
    x.info = {"tq": prepared.num_q_tokens, "tk": prepared.num_kv_tokens, "b": prepared.num_requests}
    assert x.ticket is not None
    x.ticket.enqueue()
    batch = prepared.batch
    out_bytes = prepared.num_q_tokens * batch.num_heads * batch.v_head_dim * batch.v.element_size()
    client = x.ticket.client  # queued work takes turns between clients
    if out_bytes > SMALL_BYTES:
        # the pool may make (pre-fault) `out` at once
        job = await asyncio.to_thread(run, client=client)
    else:
        job = run(loop=asyncio.get_running_loop(), client=client)
    waiting = job.settled(x.remaining(s.deadline_s))  # a future: no task to step through
    watcher: asyncio.Future[None] = asyncio.ensure_future(gone)
    watch: set[asyncio.Future[Any]] = {waiting, watcher}
    await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
    if not waiting.done() and job.replying:
        # Its worker answers the client itself, who may read that answer and hang up before
        # the worker's Done is read here: the job's outcome decides, within the deadline as
        # any job's, not the hang-up (which counted answered calls as 499s).
        await asyncio.wait({waiting})
    if not waiting.done():
        _abandon(state, job, waiting, x)
        raise ClientGoneError
    watcher.cancel()
    result = waiting.result()  # DeadlineExceededError past the deadline
    done_at = time.perf_counter()
    queue_s = (job.started_at or done_at) - job.queued_at
    compute_s = done_at - (job.started_at or done_at)
    state.metrics.observe("queue", queue_s)
    state.metrics.observe("compute", compute_s)
    state.metrics.count_tokens(prepared.num_q_tokens, prepared.num_kv_tokens)
    return result, (queue_s, compute_s)


def _abandon(
    state: ServiceState, job: PrefillJob, waiting: asyncio.Future[PrefillResult], x: Exchange
) -> None:
    """The client hung up while its work was queued or running.

    Work no worker has started is dropped. Work that started runs on (stopping a worker costs
    a restart of seconds, which no client may cause at will) and still holds its queue place,
    its body's buffer and its bytes until it ends or its deadline stops it: hanging up costs
    the others no more than waiting for the answer would.
    """
    if job.started_at is None:
        waiting.cancel()
        return
    ticket, x.ticket = x.ticket, None
    held = Exchange(x.route, buf=x.buf, staging=x.staging)  # what the work reads, until it ends
    x.buf, x.staging = None, []
    engine = state.engine

    async def finish() -> None:
        try:
            (await waiting).release()
        except Exception:  # past its deadline, or failed: nobody is waiting for the answer
            pass
        finally:
            if engine is not None:
                await drop_body(engine, held)
            if ticket is not None:
                ticket.close()

    task = asyncio.ensure_future(finish())
    state.abandoned.add(task)
    task.add_done_callback(state.abandoned.discard)


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


def timed(response: R, ingest_s: float, queue_s: float, compute_s: float, x: Exchange) -> R:
    response.headers["Server-Timing"] = (
        f"ingest;dur={ingest_s * 1e3:.3f}, queue;dur={queue_s * 1e3:.3f}, "
        f"compute;dur={compute_s * 1e3:.3f}"
    )
    x.info |= {
        "ingest_ms": round(ingest_s * 1e3, 3),
        "queue_ms": round(queue_s * 1e3, 3),
        "compute_ms": round(compute_s * 1e3, 3),
    }
    return response
