"""The run phase of the one pipeline (`pipeline.serve`): a prepared request queued for its
caller on the engine's workers and waited for, within the service's deadline, while its door
watches for a hang-up and, where the caller sent one, its own deadline passes over work still
queued (`zen_mla.deadline`). A hang-up or a caller's deadline drops work no worker was given;
work begun runs on, holding what it reads, until it ends or the service's deadline stops it."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from zen_mla import DeadlineExceededError
from zen_mla.deadline import Deadline
from zen_mla.engine import (
    OutputPlaces,
    PrefillJob,
    PrefillRequest,
    PrefillResult,
    Reply,
    SharedBuffer,
)

from .body import SMALL_BYTES
from .forms.base import ClientGoneError, RequestRecord
from .held import Held
from .state import ServiceState

__all__ = ["compute"]


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
    caller: Deadline | None = None,
) -> PrefillResult:
    """Queue the prepared request for `held`'s caller and wait for it within the deadline,
    watching the client (`gone`, an awaitable that completes when it hangs up; cancelled once
    the work is done; a hang-up while the job's worker holds its reply does not count, see
    `PrefillJob.replying`); its (queue, compute) seconds go to `record`. A small request is
    run from this thread (`loop=`): one small enough for one worker goes straight to an idle
    one, with no thread between. Work still queued at the `caller`'s deadline is dropped
    (DeadlineExceededError); work begun runs on to its end or the service's deadline."""
    engine = state.engine
    assert engine is not None and held.ticket is not None, "read first"
    if caller is not None and caller.passed():
        raise _not_computed(caller)  # its deadline passed before it was queued
    record.info |= {
        "tq": prepared.num_q_tokens,
        "tk": prepared.num_kv_tokens,
        "b": prepared.num_seqs,
    }
    held.ticket.enqueue()
    batch = prepared.batch
    out_bytes = prepared.num_q_tokens * batch.num_heads * batch.v_head_dim * batch.q.element_size()
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
    waiting = job.settled(record.deadline.remaining())  # a future: no task to step
    watcher: asyncio.Future[None] = asyncio.ensure_future(gone)
    watch: set[asyncio.Future[Any]] = {waiting, watcher}
    expiry = _when(caller)
    if expiry is not None:
        watch.add(expiry)
    while True:
        await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
        if expiry is None or not expiry.done() or waiting.done() or watcher.done():
            break
        watch.discard(expiry)  # the caller's deadline passed while its work waited or ran
        if job.withdraw():  # queued still: no worker took any of it, none ever will
            waiting.cancel()
            watcher.cancel()
            assert caller is not None
            raise _not_computed(caller)
    if expiry is not None:
        expiry.cancel()
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


def _not_computed(caller: Deadline) -> DeadlineExceededError:
    return DeadlineExceededError(
        f"the caller's deadline of {caller.budget:g} s passed before a worker took the request: "
        "it was not computed"
    )


def _when(deadline: Deadline | None) -> asyncio.Future[None] | None:
    """A future done at `deadline` (the loop's clock is the monotonic one), or None."""
    if deadline is None or deadline.at is None:
        return None
    loop = asyncio.get_running_loop()
    due: asyncio.Future[None] = loop.create_future()

    def come() -> None:
        if not due.done():
            due.set_result(None)

    timer = loop.call_at(deadline.at, come)
    due.add_done_callback(lambda _: timer.cancel())
    return due


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
