"""`PoolJob.withdraw()`, what a caller whose client hung up does: a job none of whose pieces a
worker was given is dropped (taken off the queues, skipped by a dispatcher thread that took a
piece meanwhile), and one a worker was given any piece of runs on. Either way no worker is
stopped for it.

The windows are held open on purpose: a dispatcher thread is stopped on entering `_hold` (a
task taken off its queue, not given to the worker yet) or `send` (given to the worker, not
sent yet), so no timing decides the outcome."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import zen_mla
from tests.pool.jobs import small_batch, submit
from zen_mla.attention import select_kernel, validate
from zen_mla.pool import PoolConfig, PoolJob, WorkerPool, _direct
from zen_mla.pool._dispatch import Dispatcher

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(PoolConfig(workers=1, heartbeat_interval=0.2, heartbeat_timeout=5)) as p:
        yield p


@pytest.fixture(scope="module")
def pool2():
    """Two workers: a batch of two requests is two tasks, one on each."""
    with WorkerPool(PoolConfig(workers=2, heartbeat_interval=0.2, heartbeat_timeout=5)) as p:
        yield p


class Stopped:
    """`d`'s dispatcher thread stopped on entering its method `name` until `go()` (another
    thread calling it passes)."""

    def __init__(self, d: Dispatcher, name: str) -> None:
        self.reached, self._go = threading.Event(), threading.Event()
        self._d, self._name = d, name
        real = getattr(d, name)

        def stopped(*args, **kwargs):
            if threading.current_thread() is d.thread and not self._go.is_set():
                self.reached.set()
                self._go.wait(30)
            return real(*args, **kwargs)

        setattr(d, name, stopped)

    def go(self) -> None:
        self._go.set()
        if self._name in vars(self._d):
            delattr(self._d, self._name)


def _idle(pool: WorkerPool, timeout: float = 60) -> list[tuple[int | None, int]]:
    """Once every worker is idle: their (pid, restarts)."""
    deadline = time.monotonic() + timeout
    while not all(w["state"] == "idle" for w in pool.workers()):
        assert time.monotonic() < deadline, pool.workers()
        time.sleep(0.02)
    return [(w["pid"], w["restarts"]) for w in pool.workers()]


def _submit_from(pool: WorkerPool, tensors, loop: asyncio.AbstractEventLoop) -> PoolJob:
    """As the service submits a small call: from the loop's thread, run directly if it can."""
    batch = validate(*tensors, None, causal=True, scale=None)
    chosen = select_kernel("auto", batch.q.dtype, return_lse=False)
    return pool.submit_batch(batch, chosen.name, return_lse=False, loop=loop)


def _assert_right(job: PoolJob, tensors) -> None:
    result = job.result(60)
    assert torch.equal(result.out, zen_mla.ragged_attention(*tensors))
    result.release()


def test_a_job_its_worker_was_given_is_started_and_runs_on(pool):
    """Given to the worker but not sent yet: the job reads as started, withdrawing it answers
    so and changes nothing, and it is answered by the same worker process."""
    before = _idle(pool)
    d = pool._dispatchers[0]
    tensors = small_batch(1)
    stop = Stopped(d, "send")
    try:
        job = submit(pool, *tensors)  # no loop: queued for the dispatcher thread
        assert stop.reached.wait(30)
        assert job.started_at is not None
        assert not job.withdraw()
        assert not job.done()
    finally:
        stop.go()
    _assert_right(job, tensors)
    assert _idle(pool) == before


def test_a_job_taken_off_the_queue_but_not_given_is_dropped(pool):
    """Taken off the queue by the dispatcher thread, not given to the worker yet: withdrawn,
    the job is cancelled, the thread skips it, the worker is untouched and takes the next."""
    before = _idle(pool)
    d = pool._dispatchers[0]
    stop = Stopped(d, "_hold")
    try:
        job = submit(pool, *small_batch(2))
        assert stop.reached.wait(30)
        assert job.started_at is None
        assert job.withdraw()
        assert job.cancelled
    finally:
        stop.go()
    tensors = small_batch(3)
    _assert_right(submit(pool, *tensors), tensors)
    assert job.started_at is None  # never given to a worker
    assert _idle(pool) == before


def test_a_queued_job_withdrawn_leaves_the_queue(pool):
    before = _idle(pool)
    d = pool._dispatchers[0]
    first, second = small_batch(4), small_batch(5)
    stop = Stopped(d, "send")
    try:
        running = submit(pool, *first)
        assert stop.reached.wait(30)
        queued = submit(pool, *second)
        assert d.queue.qsize() == 1 and d.queue.load > 0
        assert queued.withdraw()
        assert queued.cancelled
        assert d.queue.qsize() == 0 and d.queue.load == 0
    finally:
        stop.go()
    _assert_right(running, first)
    assert queued.started_at is None
    assert _idle(pool) == before


def test_a_job_run_directly_is_started_at_once(pool):
    """From the loop's thread to an idle worker: the worker has it when `submit_batch`
    returns, so a hang-up at any moment after lets it run on."""
    before = _idle(pool)
    tensors = small_batch(6)

    async def main() -> None:
        for _ in range(10):  # queued instead while the dispatcher thread looked in on it
            job = _submit_from(pool, tensors, asyncio.get_running_loop())
            direct = pool._dispatchers[0].owner == "loan"
            if direct:
                assert job.started_at is not None
                assert not job.withdraw()
            result = await asyncio.wrap_future(job.future)
            assert torch.equal(result.out, zen_mla.ragged_attention(*tensors))
            result.release()
            if direct:
                return
        raise AssertionError("never run directly")

    asyncio.run(main())
    assert _idle(pool) == before


def test_a_loan_that_could_not_start_leaves_the_job_not_started(pool, monkeypatch):
    """A loan whose pipe the loop cannot watch (out of descriptors) is given back with nothing
    sent and the task queued: the job is as if never given, and withdrawing drops it."""
    tried: list[int] = []

    def out_of_descriptors(fd: int) -> int:
        tried.append(fd)
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(_direct, "os", SimpleNamespace(dup=out_of_descriptors, close=os.close))
    before = _idle(pool)
    d = pool._dispatchers[0]
    stop = Stopped(d, "_hold")

    async def main() -> PoolJob:
        return _submit_from(pool, small_batch(7), asyncio.get_running_loop())

    try:
        job = asyncio.run(main())
        assert tried, "the loan was not tried"
        assert stop.reached.wait(30)  # queued for the dispatcher thread instead
        assert job.started_at is None
        assert job.withdraw()
    finally:
        stop.go()
    tensors = small_batch(8)
    _assert_right(submit(pool, *tensors), tensors)
    assert _idle(pool) == before


def test_a_job_is_started_once_any_of_its_pieces_was_given(pool2):
    """Two tasks on two workers: one given to its worker, the other taken off its queue but
    not given yet. The job has started: withdrawing answers so, and both run to a right
    result."""
    before = _idle(pool2)
    d0, d1 = pool2._dispatchers
    tensors = small_batch(9, tokens=1024)
    stops = [Stopped(d0, "send"), Stopped(d1, "_hold")]
    try:
        job = submit(pool2, *tensors)
        assert all(s.reached.wait(30) for s in stops)
        assert job._pending == 2, "the batch was not split in two"
        assert not job.withdraw()
    finally:
        for s in stops:
            s.go()
    _assert_right(job, tensors)
    assert _idle(pool2) == before


def test_a_job_none_of_whose_pieces_was_given_is_dropped_whole(pool2):
    before = _idle(pool2)
    stops = [Stopped(d, "_hold") for d in pool2._dispatchers]
    try:
        job = submit(pool2, *small_batch(10, tokens=1024))
        assert all(s.reached.wait(30) for s in stops)
        assert job.withdraw()
    finally:
        for s in stops:
            s.go()
    tensors = small_batch(11, tokens=1024)
    _assert_right(submit(pool2, *tensors), tensors)
    assert job.cancelled and job.started_at is None
    assert _idle(pool2) == before
