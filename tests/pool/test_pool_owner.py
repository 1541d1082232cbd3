"""One owner per worker: the dispatcher thread and a borrower (a loop running a task directly)
never hold one worker at once, and an answer that names another task never settles a job.

The windows are held open on purpose (the dispatcher stopped between taking a task and sending
it, or while it reads an idle worker's heartbeats), so no timing decides the outcome."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

import zen_mla
from tests.pool.jobs import run, small_batch, submit
from zen_mla import KernelError
from zen_mla.attention import select_kernel, validate
from zen_mla.pool import PoolConfig, PoolJob, WorkerPool
from zen_mla.pool._job import Task
from zen_mla.pool._messages import RunTask

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(PoolConfig(workers=1, heartbeat_interval=0.2, heartbeat_timeout=5)) as p:
        yield p


def _submit_from(pool: WorkerPool, tensors, loop: asyncio.AbstractEventLoop) -> PoolJob:
    """As the service submits a small call: from the loop's thread, run directly if it can."""
    batch = validate(*tensors, None, causal=True, scale=None)
    chosen = select_kernel("auto", batch.q.dtype, return_lse=False)
    return pool.submit_batch(batch, chosen.name, return_lse=False, loop=loop)


def _stand_in_task() -> Task:
    return Task(0, PoolJob(kernel="torch"), None, [], 0)  # type: ignore[arg-type]


def _idle(pool: WorkerPool, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while pool.workers()[0]["state"] != "idle":
        assert time.monotonic() < deadline, pool.workers()
        time.sleep(0.02)


def test_a_worker_the_dispatcher_took_a_task_for_is_not_lent(pool):
    """The dispatcher thread holds the worker from the moment it takes a task: stopped there,
    before it sends the task, a loan is refused and a call from a loop queues behind it."""
    d = pool._dispatchers[0]
    took, go = threading.Event(), threading.Event()
    real_send = d.send

    def held_send(proc, task, reply=None):
        if threading.current_thread() is d.thread:
            took.set()
            go.wait(30)
        return real_send(proc, task, reply)

    first, second = small_batch(1), small_batch(2)
    d.send = held_send
    try:
        job = submit(pool, *first)  # no loop: queued for the dispatcher thread
        assert took.wait(30)
        assert d.lend(_stand_in_task()) is None
        assert d.owner == "thread"

        async def call() -> torch.Tensor:
            direct = _submit_from(pool, second, asyncio.get_running_loop())
            go.set()
            result = await asyncio.wrap_future(direct.future)
            out = result.out.clone()
            result.release()
            return out

        out = asyncio.run(call())
        result = job.result(30)
    finally:
        go.set()
        del d.send
    assert torch.equal(result.out, zen_mla.ragged_attention(*first))
    assert torch.equal(out, zen_mla.ragged_attention(*second))
    result.release()
    assert pool.workers()[0]["restarts"] == 0


def test_an_idle_worker_whose_heartbeats_are_being_read_is_not_lent(pool):
    """Reading an idle worker's heartbeats is holding it too: a loan in that moment is refused
    (two readers of one pipe tear its messages apart)."""
    _idle(pool)
    d = pool._dispatchers[0]
    looking, go = threading.Event(), threading.Event()
    real_look = d._look_in

    def held_look() -> None:
        looking.set()
        go.wait(30)
        real_look()

    d._look_in = held_look
    try:
        assert looking.wait(30)
        assert d.lend(_stand_in_task()) is None
    finally:
        go.set()
        del d._look_in
    task, deadline = _stand_in_task(), time.monotonic() + 30
    while d.lend(task) is None:  # free again once the look is over (between the next ones)
        assert time.monotonic() < deadline, pool.workers()
        time.sleep(0.01)
    assert d.current is task and d.owner == "loan"
    d.give_back()
    assert pool.workers()[0]["restarts"] == 0


def _answering_for_another_task(d) -> None:
    """The worker's next task goes out under another task's number, so its answer names a task
    the pool is not running."""
    proc = d.proc
    real = proc.send

    def renumbered(msg, fds=()):
        if isinstance(msg, RunTask):
            msg = replace(msg, task_id=msg.task_id + 1_000_000)
        return real(msg, fds)

    proc.send = renumbered


@pytest.mark.parametrize("path", ["dispatcher", "loan"])
def test_an_answer_to_another_task_fails_the_task_and_replaces_the_worker(pool, path):
    _idle(pool)
    d = pool._dispatchers[0]
    before = pool.workers()[0]
    tensors = small_batch(3)
    _answering_for_another_task(d)

    if path == "dispatcher":
        job = submit(pool, *tensors)
    else:

        async def direct() -> PoolJob:
            job = _submit_from(pool, tensors, asyncio.get_running_loop())
            with contextlib.suppress(KernelError):
                await asyncio.wait_for(asyncio.wrap_future(job.future), 30)
            return job

        job = asyncio.run(direct())
    with pytest.raises(KernelError, match="protocol error"):
        job.result(30)
    _idle(pool)
    after = pool.workers()[0]
    assert after["restarts"] == before["restarts"] + 1 and after["pid"] != before["pid"]
    result = run(pool, *tensors, timeout=30)  # the replacement answers as it should
    assert torch.equal(result.out, zen_mla.ragged_attention(*tensors))
    result.release()


def test_loops_and_the_dispatcher_at_once_get_only_their_own_answers(pool):
    """Four threads with an event loop each calling directly, two submitting to the queue: every
    answer is its own call's, no worker restarts, nothing waits past its time."""
    _idle(pool)
    before = pool.workers()[0]
    cases = [small_batch(10 + i, tokens=1 + 7 * i) for i in range(6)]
    expected = [zen_mla.ragged_attention(*c) for c in cases]
    stop_at = time.monotonic() + 6

    def looping(i: int) -> int:
        async def calls() -> int:
            n = 0
            while time.monotonic() < stop_at:
                job = _submit_from(pool, cases[i], asyncio.get_running_loop())
                result = await asyncio.wait_for(asyncio.wrap_future(job.future), 20)
                assert torch.equal(result.out, expected[i]), f"caller {i}, call {n}"
                result.release()
                n += 1
            return n

        return asyncio.run(calls())

    def queueing(i: int) -> int:
        n = 0
        while time.monotonic() < stop_at:
            result = run(pool, *cases[i], timeout=20)
            assert torch.equal(result.out, expected[i]), f"caller {i}, call {n}"
            result.release()
            n += 1
        return n

    with ThreadPoolExecutor(6) as ex:
        futures = [ex.submit(looping, i) for i in range(4)]
        futures += [ex.submit(queueing, i) for i in (4, 5)]
        counts = [f.result(60) for f in futures]
    assert all(n > 0 for n in counts), counts
    after = pool.workers()[0]
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"])
