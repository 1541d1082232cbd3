"""A task run on a lent worker from an event loop (`submit_batch(loop=)`, `pool/_direct.py`):
the same results, answers read in the loop's thread, and every fault the dispatcher thread
handles handled the same way: a worker killed, cancelled or stopped mid-task, a task that
fails, work queued behind a loan."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

import zen_mla
from tests.reference import assert_close_to_reference
from zen_mla.attention import select_kernel, validate
from zen_mla.pool import PoolConfig, PoolJob, PoolResult, WorkerPool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(PoolConfig(workers=1, heartbeat_interval=0.2, heartbeat_timeout=1.5)) as p:
        yield p


def _submit(pool: WorkerPool, tensors, loop, *, kernel="auto", causal=True) -> PoolJob:
    batch = validate(*tensors, None, causal=causal, scale=None)
    chosen = select_kernel(kernel, batch.q.dtype, return_lse=False)
    return pool.submit_batch(batch, chosen.name, return_lse=False, loop=loop)


def _small(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(9, 16, 192, generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(9, 16, 128, generator=g, dtype=torch.bfloat16)
    return q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32)


def _slow(tokens: int = 5000):
    """Non-causal fp32 reference work (of seconds on one core at 5000 tokens)."""
    x = torch.randn(tokens, 4, 128)
    return x, x, x, torch.tensor([0, tokens])


async def _busy(pool: WorkerPool, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [w for w in pool.workers() if w["state"] == "busy"]
        if busy:
            return busy[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no worker became busy: {pool.workers()}")


def _wait_alive(pool: WorkerPool, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(w["state"] == "idle" for w in pool.workers()):
        assert time.monotonic() < deadline, pool.workers()
        time.sleep(0.05)


async def _run_noting_thread(pool: WorkerPool, tensors, loop) -> tuple[PoolResult, str]:
    """`tensors` run from `loop`: the result, and the thread its job completed in."""
    job = _submit(pool, tensors, loop)
    finished_in: list[str] = []
    job.future.add_done_callback(lambda _: finished_in.append(threading.current_thread().name))
    result = await asyncio.wrap_future(job.future)
    return result, finished_in[0]


def test_answers_are_read_in_the_loops_thread(pool):
    tensors = _small()
    expected = zen_mla.ragged_attention(*tensors)
    finished_in: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(20):
            result, thread = await _run_noting_thread(pool, tensors, loop)
            finished_in.append(thread)
            assert torch.equal(result.out, expected)
            result.release()

    asyncio.run(main())
    # the dispatcher thread (zen-mla-worker-0) was never between the loop and the worker
    assert set(finished_in) == {threading.main_thread().name}
    assert pool.workers()[0]["state"] == "idle"


def test_a_call_while_the_worker_is_lent_queues_behind_it(pool):
    slow, small = _slow(), _small(1)
    expected = zen_mla.ragged_attention(*small)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        first = _submit(pool, slow, loop, kernel="reference", causal=False)
        await _busy(pool)
        second = _submit(pool, small, loop)  # the worker is lent: queued for the thread
        results = await asyncio.gather(
            asyncio.wrap_future(first.future), asyncio.wrap_future(second.future)
        )
        assert_close_to_reference(*slow, None, False, results[0].out)
        assert torch.equal(results[1].out, expected)
        for r in results:
            r.release()

    asyncio.run(main())
    assert pool.workers()[0]["restarts"] == 0


def test_a_worker_killed_mid_task_is_replaced_and_the_task_run_again(pool):
    restarts = pool.workers()[0]["restarts"]
    slow = _slow()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        job = _submit(pool, slow, loop, kernel="reference", causal=False)
        worker = await _busy(pool)
        os.kill(worker["pid"], signal.SIGKILL)
        result = await asyncio.wrap_future(job.future)  # run again on the replacement
        assert_close_to_reference(*slow, None, False, result.out)
        result.release()
        assert pool.workers()[0]["pid"] != worker["pid"]

    asyncio.run(main())
    assert pool.workers()[0]["restarts"] == restarts + 1
    _wait_alive(pool)


def test_a_cancelled_task_stops_its_worker_and_the_next_call_runs(pool):
    restarts = pool.workers()[0]["restarts"]
    tensors = _small(2)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        job = _submit(pool, _slow(), loop, kernel="reference", causal=False)
        await _busy(pool)
        job.cancel()
        nxt = _submit(pool, tensors, loop)  # queued behind the replacement
        result = await asyncio.wait_for(asyncio.wrap_future(nxt.future), 120)
        assert torch.equal(result.out, zen_mla.ragged_attention(*tensors))
        result.release()

    asyncio.run(main())
    assert pool.workers()[0]["restarts"] == restarts + 1


def test_a_stopped_lent_worker_is_reported_stuck_and_left_to_resume(pool):
    slow = _slow()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        job = _submit(pool, slow, loop, kernel="reference", causal=False)
        worker = await _busy(pool)
        os.kill(worker["pid"], signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while pool.workers()[0]["state"] != "stuck":
                assert time.monotonic() < deadline, pool.workers()
                await asyncio.sleep(0.05)
        finally:
            os.kill(worker["pid"], signal.SIGCONT)
        result = await asyncio.wrap_future(job.future)
        assert_close_to_reference(*slow, None, False, result.out)
        result.release()
        assert pool.workers()[0]["pid"] == worker["pid"]

    restarts = pool.workers()[0]["restarts"]
    asyncio.run(main())
    state = pool.workers()[0]
    assert state["state"] == "idle" and state["restarts"] == restarts


def test_a_task_that_fails_in_the_worker_fails_its_job_only(pool):
    tensors = _small(3)
    batch = validate(*tensors, None, causal=True, scale=None)
    restarts = pool.workers()[0]["restarts"]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # a kernel the worker does not know: it raises there, and says so in a Failed answer
        job = pool.submit_batch(batch, "no-such-kernel", return_lse=False, loop=loop)
        with pytest.raises(zen_mla.KernelError, match="no-such-kernel"):
            await asyncio.wrap_future(job.future)
        result = await asyncio.wrap_future(_submit(pool, tensors, loop).future)
        assert torch.equal(result.out, zen_mla.ragged_attention(*tensors))
        result.release()

    asyncio.run(main())
    state = pool.workers()[0]
    assert state["state"] == "idle" and state["restarts"] == restarts


def test_out_of_descriptors_the_task_is_queued_and_the_worker_kept(pool, monkeypatch):
    """The loop watches a duplicate of the worker's pipe; with no descriptor left to make one
    the task goes to the dispatcher thread instead, and the worker is not taken for dead. (The
    loop's `dup` is made to fail as it fails out of descriptors: exhausting the process's own
    let a descriptor freed meanwhile decide the test on some hosts.)"""
    import errno
    from types import SimpleNamespace

    from zen_mla.pool import _direct

    def out_of_descriptors(fd: int) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(_direct, "os", SimpleNamespace(dup=out_of_descriptors, close=os.close))
    d = pool._dispatchers[0]
    settled_in: list[threading.Thread] = []
    settle = d.settle

    def noting(task, outcome):  # the thread that read the answer (a job's own callbacks run
        settled_in.append(threading.current_thread())  # where it is done: a race here)
        settle(task, outcome)

    monkeypatch.setattr(d, "settle", noting)
    tensors = _small(4)
    expected = zen_mla.ragged_attention(*tensors)
    _wait_alive(pool)
    before = [(w["pid"], w["restarts"]) for w in pool.workers()]

    async def main() -> None:
        result = await asyncio.wrap_future(
            _submit(pool, tensors, asyncio.get_running_loop()).future
        )
        assert torch.equal(result.out, expected)
        result.release()

    asyncio.run(main())
    assert settled_in == [d.thread]  # the dispatcher thread ran it
    assert [(w["pid"], w["restarts"]) for w in pool.workers()] == before
    _wait_alive(pool)


def test_settled_in_the_loop_at_once_or_through_it_from_another_thread(pool):
    """A direct run's job settles its loop future in the loop's own thread, with no hand-over
    through the loop's wake-up pipe; a job queued to the dispatcher thread (a `loop`-less
    submit) settles it through `call_soon_threadsafe`; either way the result is the job's,
    and a failure its exception."""
    tensors = _small(4)
    expected = zen_mla.ragged_attention(*tensors)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        handed: list[object] = []
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            handed.append(callback)
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        direct = _submit(pool, tensors, loop)
        result = await direct.settled_in(loop)
        assert torch.equal(result.out, expected)
        result.release()
        assert handed == []

        # tens of ms of work: still running when settled_in is called (a job already done
        # settles its future there and then, in this thread)
        medium = _slow(1200)
        queued = _submit(pool, medium, None, kernel="reference", causal=False)
        result = await queued.settled_in(loop)
        assert torch.equal(
            result.out, zen_mla.ragged_attention(*medium, kernel="reference", causal=False)
        )
        result.release()
        assert len(handed) == 1

        converted = _submit(pool, tensors, loop)  # the caller's type, in the same future
        out = await converted.settled_in(loop, lambda r: (r.out.clone(), r.release())[0])
        assert torch.equal(out, expected)

        batch = validate(*tensors, None, causal=True, scale=None)
        failing = pool.submit_batch(batch, "no-such-kernel", return_lse=False, loop=loop)
        with pytest.raises(zen_mla.KernelError, match="no-such-kernel"):
            await failing.settled_in(loop)

    asyncio.run(main())


def test_cancelling_the_loop_future_cancels_the_job(pool):
    """As an awaiting task cancelled: the job is cancelled, its worker stopped and replaced,
    and the next call runs."""
    restarts = pool.workers()[0]["restarts"]
    tensors = _small(5)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        job = _submit(pool, _slow(), loop, kernel="reference", causal=False)
        settled = job.settled_in(loop)
        await _busy(pool)
        settled.cancel()
        await asyncio.sleep(0)  # a future's callbacks run on the loop's next turn
        assert job.cancelled
        nxt = _submit(pool, tensors, loop)  # queued behind the replacement
        result = await asyncio.wait_for(nxt.settled_in(loop), 120)
        assert torch.equal(result.out, zen_mla.ragged_attention(*tensors))
        result.release()

    asyncio.run(main())
    assert pool.workers()[0]["restarts"] == restarts + 1


def test_heartbeats_queued_before_the_answer_are_read_a_turn_each():
    # The loop's thread is held while the task runs: the worker's heartbeats (one each 0.2 s,
    # its watchdog's pace) pile up in the pipe ahead of its Done, and the loop then reads them
    # one message a turn (the pipe stays readable until the last).
    tensors = _slow(1500)
    expected = zen_mla.ragged_attention(*tensors, kernel="reference")

    async def main(p: WorkerPool) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(2):
            job = _submit(p, tensors, loop, kernel="reference")
            time.sleep(1.5)  # the loop is blocked: nothing is read meanwhile
            result = await asyncio.wait_for(asyncio.wrap_future(job.future), 60)
            assert torch.equal(result.out, expected)
            result.release()

    with WorkerPool(PoolConfig(workers=1, heartbeat_interval=0.002, heartbeat_timeout=30)) as p:
        asyncio.run(main(p))
        assert p.workers()[0]["state"] == "idle"
        assert p.workers()[0]["restarts"] == 0
