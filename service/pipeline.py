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
               deadline while the door watches for a hang-up (`compute`); dropped unbegun at
               the caller's own deadline, where the request carries one (`zen_mla.deadline`)
    answer     the kernel's bytes and the inputs' buffers back first, then the form writes the
               answer, whose bytes stay charged until its last byte is sent (or it is cut for
               being read slower than the door's minimum rate)
    account    whatever happened: admission and buffers given back, metrics, the log line

The form supplies only the read and the answer (`form`), the door who sent it and where its
bytes are (`doors`); each is called from here and returns here. A zen_mla error is answered in
the form's shape; any other is a bug of ours, a 500 (InternalError); a hang-up a 499 (metrics)."""

from __future__ import annotations

import json
import logging
import time
from typing import TypeVar

from starlette.requests import ClientDisconnect

from zen_mla import (
    InternalError,
    KernelError,
    WorkTooLargeError,
    ZenMLAError,
    status_of,
)
from zen_mla.deadline import Deadline
from zen_mla.engine import (
    OutputPlaces,
    PrefillEngine,
    PrefillRequest,
    SharedBuffer,
)

from .admission import Ticket
from .answer import Streamed
from .body import read_body, read_message
from .compute import compute
from .doors import Door
from .forms.base import ClientGoneError, Computed, Expect, Form, RequestRecord, Work
from .held import Held
from .pace import Pace
from .settings import Settings
from .state import ServiceState, readiness

__all__ = ["ready_engine", "serve"]

log = logging.getLogger("zen_mla.service")
A = TypeVar("A")


def ready_engine(state: ServiceState) -> PrefillEngine:
    """The engine, while the service admits compute requests (`readiness`); else its 503."""
    now = readiness(state)
    if not now.admitting or state.engine is None:
        raise now.error(retry_after=5)
    return state.engine


async def serve(state: ServiceState, door: Door, form: Form[A]) -> A:
    """`form`'s request, come in by `door`, from its gate to its log line (see the module)."""
    record = RequestRecord(form.route, time.perf_counter(), Deadline(state.settings.deadline_s))
    held = Held(state.engine)
    try:
        if form.computes:
            ready_engine(state)
        door.authorize(state.tenants)
        record.info["caller"] = str(door.caller)  # who is charged, in the log line
        timeout = door.timeout()  # the caller's seconds, where its transport carries them
        expect = form.expect(state.settings, door)
        engine = _engine(state)
        body = await _read(state, door, expect, record, held)
        work = await form.decode(body, engine, record)
        del body  # a whole message (gRPC) is in the work's buffer now: not held twice meanwhile
        if work is None:
            form.keep(held)
            answer = await form.answer(None, record)
        else:
            staging = work.staging  # what the work made and borrowed, held from here on
            held.keep([staging] if isinstance(staging, SharedBuffer) else list(staging or ()))
            held.borrow(work.leases)
            caller = _caller_deadline(record, timeout, work.timeout)
            answer = await _run(state, door, form, work, record, held, caller)
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
    deadline_at = record.deadline.at
    assert deadline_at is not None, "the service's deadline is a number of seconds"
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
    caller: Deadline | None,
) -> A:
    engine = _engine(state)
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
            caller=caller,
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
        answer = await form.answer(Computed(result, charge), record)
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


def _caller_deadline(record: RequestRecord, *timeouts: float | None) -> Deadline | None:
    """The caller's deadline, the soonest of the `timeouts` it sent (seconds, counted from the
    request's arrival), where it is sooner than the service's own; else None."""
    given = [t for t in timeouts if t is not None]
    if not given:
        return None
    caller = Deadline(min(given), start=record.deadline.start)
    assert caller.at is not None and record.deadline.at is not None
    return caller if caller.at < record.deadline.at else None


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
