"""The one pipeline: every request that brings bytes in (a `/prefill` in either body form, a
region-socket call, a `/v2` infer, a `/v2` registration) lives its whole life in `serve`.

    gate       admitting (`ready_engine`), the door's token
    expect     the form says from the request's head what body it expects (`Form.expect`)
    read       admission and the caller's share before a byte is read, then the one body
               reader (`body`) or the socket's frame, within the request's deadline
    decode     the form makes the bytes its tensors and options (`Form.decode`)
    prepare    validated once, within the caps, kernels chosen (`PrefillEngine.prepare`)
    charge     what the kernel will allocate and the answer will hold, to the caller's bytes
    run        queued for the caller (round-robin between callers), waited for within the
               deadline while the door watches for a hang-up (`compute`)
    answer     the kernel's bytes and the inputs' buffers back first, then the form writes the
               answer, whose bytes stay charged until its last byte is sent (or it is cut for
               being read slower than the door's minimum rate)
    account    whatever happened: admission and buffers given back, metrics, the log line

The form supplies only the read and the answer (`form`), the door who sent it and where its
bytes are (`doors`); each is called from here and returns here. A zen_mla error is answered in
the form's shape; any other is a bug of ours, a 500 (InternalError); a hang-up a 499 (metrics)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect

from zen_mla import (
    InternalError,
    KernelError,
    WorkTooLargeError,
    ZenMLAError,
    status_of,
)
from zen_mla.engine import (
    OutputPlaces,
    PrefillEngine,
    PrefillJob,
    PrefillRequest,
    PrefillResult,
    Reply,
    SharedBuffer,
)

from .admission import Ticket
from .answer import Streamed
from .body import SMALL_BYTES, read_body, read_message
from .doors import Door
from .forms.base import Expect, Form, RequestRecord, Work
from .held import Held
from .pace import Pace
from .settings import Settings
from .state import ServiceState, readiness

__all__ = ["ClientGoneError", "compute", "ready_engine", "serve"]

log = logging.getLogger("zen_mla.service")
A = TypeVar("A")


class ClientGoneError(Exception):
    """The client closed the connection while its work ran (answered 499, for metrics)."""


def ready_engine(state: ServiceState) -> PrefillEngine:
    """The engine, while the service admits compute requests (`readiness`); else its 503."""
    now = readiness(state)
    if not now.admitting or state.engine is None:
        raise now.error(retry_after=5)
    return state.engine


async def serve(state: ServiceState, door: Door, form: Form[A]) -> A:
    """`form`'s request, come in by `door`, from its gate to its log line (see the module)."""
    record = RequestRecord(form.route, time.perf_counter())
    held = Held(state.engine)
    try:
        if form.computes:
            ready_engine(state)
        door.authorize(state.tenants)
        record.info["caller"] = str(door.caller)  # who is charged, in the log line
        expect = form.expect(state.settings, door)
        engine = _engine(state)
        body = await _read(state, door, expect, record, held)
        work = await form.decode(body, engine, record)
        del body  # a whole message (gRPC) is in the work's buffer now: not held twice meanwhile
        if work is None:
            answer = await form.answer(None, record)
        else:
            answer = await _run(state, door, form, work, record, held)
        record.status = 200
        return answer
    except (ClientDisconnect, ClientGoneError):
        record.status = 499
        return form.hung_up()
    except ZenMLAError as exc:
        record.status = status_of(exc)
        # Answered before the whole body came: the connection closes (lingering, see
        # protocol.py) rather than reading an unbounded rest of the body to keep it alive.
        return form.refuse(exc, record, {} if record.bytes_in else {"Connection": "close"})
    except Exception as exc:  # a bug of ours: a 500 of its own class, never a dropped connection
        log.exception("%s failed", form.route)
        record.status = 500
        error = InternalError(f"internal error: {type(exc).__name__}: {exc}")
        return form.refuse(error, record, {})
    finally:
        await held.release()
        _account(state, record)


def _engine(state: ServiceState) -> PrefillEngine:
    """The engine, for its buffers (a form that computes nothing passes no gate)."""
    if state.engine is None:
        raise readiness(state).error(retry_after=5)
    return state.engine


async def _read(
    state: ServiceState, door: Door, expect: Expect, record: RequestRecord, held: Held
) -> SharedBuffer | bytes:
    """The request's bytes, admitted for its caller before any is read: a whole message (gRPC)
    charged the most its transport may read; a socket's frame as it is; a body as it comes."""
    admission, s = state.admission, state.settings
    deadline_at = asyncio.get_running_loop().time() + _remaining(s, record)
    if door.whole:  # one message its transport reads whole: admitted before it is awaited
        admission.check_queue(door.caller)
        most = door.most(expect.limit)  # what its transport may read: held before it reads
        ticket = held.ticket = admission.admit(most, door.caller)
        ticket.charge(most)
        message = await read_message(
            door.read, ticket, deadline_at=deadline_at, deadline_s=s.deadline_s
        )
        n = ticket.got = door.body_size(expect.limit)
        ticket.trim(door.kept(n))
        ticket.uploaded()
        _arrived(record, n)
        return message
    n = door.body_size(expect.limit)
    raw = door.arrived()
    if raw is not None:
        held.ticket = admission.admit_read(n, door.caller)
        _arrived(record, n)
        return raw
    admission.check_queue(door.caller)  # a full queue now is a 429 now, not after the upload
    ticket = held.ticket = admission.admit(n, door.caller)
    buf = await read_body(
        door.receive,
        held,
        Pace.of(s),
        deadline_at=deadline_at,
        deadline_s=s.deadline_s,
        lead=expect.lead,
    )
    _arrived(record, n)
    ticket.uploaded()
    if not expect.small:
        return buf
    try:
        return bytes(buf.bytes_view[:n])
    finally:
        await held.release_buffers()


def _arrived(record: RequestRecord, nbytes: int) -> None:
    record.bytes_in = nbytes
    record.ingest_s = time.perf_counter() - record.t0


async def _run(
    state: ServiceState,
    door: Door,
    form: Form[A],
    work: Work,
    record: RequestRecord,
    held: Held,
) -> A:
    engine = _engine(state)
    staging = work.staging
    held.keep([staging] if isinstance(staging, SharedBuffer) else list(staging or ()))
    prepared = engine.prepare(work.tensors, work.options)
    places = form.places(prepared)
    reply = form.reply(prepared)
    assert held.ticket is not None, "read first"
    _charge(held.ticket, prepared, places, state.settings)
    try:
        result = await compute(
            state,
            door.gone(),
            prepared,
            record,
            held,
            inputs=work.inputs,
            places=places,
            reply=reply,
        )
    except KernelError as exc:
        form.explain(exc)
        raise
    ticket = held.ticket
    ticket.refund("kernel")  # its work is done
    await held.release_buffers()  # the inputs' memory, before the answer goes out
    ticket.refund("body")
    if places is not None:
        result.release()  # written where the caller said: no memory of the pool's to keep
    charge = ticket.keep("answer")  # until the answer's memory is back: its last byte sent
    try:
        answer = await form.answer(result.when_released(charge.close_soon), record)
    except BaseException:
        charge.close()
        raise
    if isinstance(answer, Streamed):
        answer.pace = Pace.of(state.settings)
    return answer


def _charge(
    ticket: Ticket, prepared: PrefillRequest, places: OutputPlaces | None, settings: Settings
) -> None:
    """What `prepared` will cost the service, to its caller's share of the bytes before it is
    queued: the kernel's memory, and the answer's where it is the pool's (not written where the
    caller said). One request may hold at most the whole budget (422 above: it never fits);
    QueueFullError (429) while others hold what it needs."""
    cost = prepared.cost
    answer = cost.result_bytes if places is None else 0
    need = ticket.charged + cost.workspace_bytes + answer
    if need > settings.max_inflight_bytes:
        raise WorkTooLargeError(
            "memory",
            f"at most {settings.max_inflight_bytes} bytes held for one request (the service's "
            "max_inflight_bytes)",
            f"{need} (body {ticket.charged}, kernel {cost.workspace_bytes}, answer {answer})",
            "Split the batch into smaller requests",
        )
    ticket.charge(cost.workspace_bytes, "kernel")
    ticket.charge(answer, "answer")


def _remaining(settings: Settings, record: RequestRecord) -> float:
    return settings.deadline_s - (time.perf_counter() - record.t0)


async def compute(
    state: ServiceState,
    gone: Awaitable[None],
    prepared: PrefillRequest,
    record: RequestRecord,
    held: Held,
    *,
    inputs: SharedBuffer | Sequence[SharedBuffer] | None = None,
    places: OutputPlaces | None = None,
    reply: Reply | None = None,
) -> PrefillResult:
    """Queue the prepared request for `held`'s caller and wait for it within the deadline,
    watching the client (`gone`, an awaitable that completes when it hangs up; cancelled once
    the work is done; a hang-up while the job's worker holds its reply does not count, see
    `PrefillJob.replying`); its (queue, compute) seconds go to `record`. A small request is
    run from this thread (`loop=`): one small enough for one worker goes straight to an idle
    one, with no thread between."""
    engine = state.engine
    assert engine is not None and held.ticket is not None, "read first"
    record.info |= {
        "tq": prepared.num_q_tokens,
        "tk": prepared.num_kv_tokens,
        "b": prepared.num_seqs,
    }
    held.ticket.enqueue()
    batch = prepared.batch
    out_bytes = prepared.num_q_tokens * batch.num_heads * batch.v_head_dim * batch.v.element_size()
    run = functools.partial(
        engine.run,
        prepared,
        inputs=inputs,
        outputs=places,
        reply=reply,
        caller=held.ticket.caller,  # queued work takes turns between callers
    )
    if out_bytes > SMALL_BYTES:
        job = await asyncio.to_thread(run)  # the pool may make (pre-fault) `out` at once
    else:
        job = run(loop=asyncio.get_running_loop())
    waiting = job.settled(_remaining(state.settings, record))  # a future: no task to step
    watcher: asyncio.Future[None] = asyncio.ensure_future(gone)
    watch: set[asyncio.Future[Any]] = {waiting, watcher}
    await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
    if not waiting.done() and job.replying:
        # Its worker answers the client itself, who may read that answer and hang up before
        # the worker's Done is read here: the job's outcome decides, within the deadline as
        # any job's, not the hang-up (which counted answered calls as 499s).
        await asyncio.wait({waiting})
    if not waiting.done():
        _abandon(state, job, waiting, held)
        raise ClientGoneError
    watcher.cancel()
    result = waiting.result()  # DeadlineExceededError past the deadline
    done_at = time.perf_counter()
    record.queue_s = (job.started_at or done_at) - job.queued_at
    record.compute_s = done_at - (job.started_at or done_at)
    state.metrics.observe("queue", record.queue_s)
    state.metrics.observe("compute", record.compute_s)
    state.metrics.count_tokens(prepared.num_q_tokens, prepared.num_kv_tokens)
    return result


def _abandon(
    state: ServiceState, job: PrefillJob, waiting: asyncio.Future[PrefillResult], held: Held
) -> None:
    """The client hung up while its work was queued or running.

    Work no worker was given is dropped (`withdraw`, decided in one step with the workers'
    taking it: a worker that took it meanwhile keeps it, never to be stopped for it). Work
    that started runs on (stopping a worker costs a restart of seconds, which no client may
    cause at will) and still holds its queue place, its body's buffer and its bytes until it
    ends or its deadline stops it: hanging up costs the others no more than waiting for the
    answer would.
    """
    if job.withdraw():
        waiting.cancel()  # an outcome come meanwhile (a failure) is nobody's to read
        return
    kept = held.hand_over()  # what the work reads, until it ends

    async def finish() -> None:
        try:
            (await waiting).release()
        except Exception:  # past its deadline, or failed: nobody is waiting for the answer
            pass
        finally:
            await kept.release()

    task = asyncio.ensure_future(finish())
    state.abandoned.add(task)
    task.add_done_callback(state.abandoned.discard)


def _account(state: ServiceState, record: RequestRecord) -> None:
    """The request's metrics and its log line."""
    total = time.perf_counter() - record.t0
    state.metrics.observe("total", total)
    state.metrics.count_request(record.route, record.status, record.bytes_in, record.bytes_out)
    if log.isEnabledFor(logging.INFO):  # no JSON built for a line not logged (~3 us)
        timings = {}
        if record.status == 200 and "tq" in record.info:
            timings = {
                "ingest_ms": round(record.ingest_s * 1e3, 3),
                "queue_ms": round(record.queue_s * 1e3, 3),
                "compute_ms": round(record.compute_s * 1e3, 3),
            }
        log.info(
            json.dumps(
                {
                    "event": record.route,
                    "request_id": record.request_id,
                    "status": record.status,
                    "bytes_in": record.bytes_in,
                    "bytes_out": record.bytes_out,
                    "total_ms": round(total * 1e3, 3),
                    **record.info,
                    **timings,
                }
            )
        )
