"""PrefillEngine: validation once, the work cap, the kernel choice and the pool behind one face,
blocking and awaitable."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import zen_mla
from tests.reference import assert_close_to_reference
from zen_mla.engine import EngineConfig, PrefillEngine
from zen_mla.pool import PoolConfig
from zen_mla.wire import PrefillOptions

H, DQK, DV = 2, 64, 32


def _batch(q_lens, kv_lens, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), H, DQK, generator=gen).to(dtype)
    k = torch.randn(sum(kv_lens), H, DQK, generator=gen).to(dtype)
    v = torch.randn(sum(kv_lens), H, DV, generator=gen).to(dtype)
    q_cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    kv_cu = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()])
    return q, k, v, q_cu, kv_cu


def tensors_of(q, k, v, q_cu, kv_cu=None):
    named = {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}
    return named | ({"kv_cu_seq_lens": kv_cu} if kv_cu is not None else {})


def submit(engine, q, k, v, q_cu, kv_cu=None, **options):
    """What every front door does: prepare (validate, caps, kernels), then run."""
    return engine.run(engine.prepare(tensors_of(q, k, v, q_cu, kv_cu), PrefillOptions(**options)))


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(PoolConfig(workers=1, heartbeat_interval=0.2))
    with PrefillEngine(config) as e:
        yield e


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
def test_result_matches_the_reference_and_names_its_kernels(engine, return_lse):
    q, k, v, q_cu, kv_cu = _batch([30, 0, 7], [30, 4, 19])
    job = submit(engine, q, k, v, q_cu, kv_cu, return_lse=return_lse)
    result = job.result(timeout=60)
    assert job.kernels == zen_mla.kernel_choice("auto", q.dtype, return_lse=return_lse)
    assert result.kernels == job.kernels
    assert_close_to_reference(q, k, v, q_cu, kv_cu, True, result.out, result.lse)
    request = job.request
    assert (request.num_seqs, request.num_q_tokens, request.num_kv_tokens) == (3, 37, 53)
    result.release()


def test_wait_from_asyncio(engine):
    q, k, v, q_cu, kv_cu = _batch([12, 5], [12, 40])

    async def main():
        jobs = [submit(engine, q, k, v, q_cu, kv_cu, causal=False, return_lse=True)]
        jobs.append(submit(engine, q, k, v, q_cu, kv_cu, kernel="reference", causal=False))
        return await asyncio.gather(*(j.wait(timeout=60) for j in jobs))

    first, second = asyncio.run(main())
    assert_close_to_reference(q, k, v, q_cu, kv_cu, False, first.out, first.lse)
    assert second.kernels == zen_mla.KernelChoice("reference", None)
    assert_close_to_reference(q, k, v, q_cu, kv_cu, False, second.out)


def test_tensors_by_name_and_a_missing_one_is_named(engine):
    q, k, v, q_cu, _ = _batch([9], [9])
    tensors = {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}
    result = engine.run(engine.prepare(tensors)).result(timeout=60)
    assert_close_to_reference(q, k, v, q_cu, None, True, result.out)
    with pytest.raises(zen_mla.InvalidInputError, match="v") as info:
        engine.prepare({"q": q, "k": k, "q_cu_seq_lens": q_cu})
    assert info.value.name == "v"


def test_bad_input_and_work_over_the_cap_are_refused_before_the_pool(engine):
    q, k, v, q_cu, kv_cu = _batch([300], [300])
    capped = PrefillEngine(EngineConfig(PoolConfig(workers=1), max_work=H * DQK * 50_000))
    # torch's kernel, whose work is the batch's own (the native kernel counts its padding)
    with pytest.raises(zen_mla.WorkTooLargeError, match="cap"):  # never started: no workers
        capped.prepare(
            tensors_of(q, k, v, q_cu, kv_cu), PrefillOptions(causal=False, kernel="torch")
        )
    causal = capped.prepare(tensors_of(q, k, v, q_cu, kv_cu), PrefillOptions(kernel="torch"))
    assert causal.batch.work() == H * DQK * 45_150
    with pytest.raises(zen_mla.InvalidInputError) as info:
        submit(engine, q, k, v[:, :, :1].expand(-1, -1, 2 * DQK), q_cu, kv_cu)
    assert info.value.name == "v"
    with pytest.raises(zen_mla.InvalidInputError, match="flash3"):
        submit(engine, q, k, v, q_cu, kv_cu, kernel="flash3")


@pytest.mark.slow
def test_a_deadline_abandons_the_work_and_the_worker_is_free_again(engine):
    q, k, v, q_cu, kv_cu = _batch([140], [140], dtype=torch.float32)
    slow = [submit(engine, q, k, v, q_cu, kv_cu, kernel="reference", causal=False)]
    slow += [submit(engine, q, k, v, q_cu, kv_cu, kernel="reference") for _ in range(200)]
    with pytest.raises(zen_mla.DeadlineExceededError, match="abandoned"):
        slow[-1].result(timeout=0.05)
    for job in slow:
        job.cancel()
    assert submit(engine, q, k, v, q_cu, kv_cu).result(timeout=60).out.shape == (140, H, DV)
    assert engine.ready()


@pytest.mark.slow
def test_an_awaited_deadline_stops_the_busy_worker(engine):
    """asyncio cancels the wrapped future itself when its awaiter times out: the busy worker
    must be stopped all the same, not left computing abandoned work."""
    q, k, v, q_cu, kv_cu = _batch([8000], [8000], dtype=torch.float32)
    before = engine.workers()[0]["restarts"]
    job = submit(engine, q, k, v, q_cu, kv_cu, kernel="reference", causal=False)

    async def main():
        while job.started_at is None:
            await asyncio.sleep(0.01)
        await job.wait(timeout=0.2)

    with pytest.raises(zen_mla.DeadlineExceededError):
        asyncio.run(main())
    deadline = time.monotonic() + 60
    while engine.workers()[0]["restarts"] == before or not engine.ready():
        assert time.monotonic() < deadline, engine.workers()
        time.sleep(0.05)


def test_settled_is_the_result_in_the_loop_with_no_task_behind_it(engine):
    """`settled()` is what `wait()` awaits: a future of the running loop, the result already
    a PrefillResult (no second future to hop through), and no task made for it."""
    q, k, v, q_cu, kv_cu = _batch([6, 3], [6, 9])

    async def main():
        loop = asyncio.get_running_loop()
        tasks_before = len(asyncio.all_tasks())
        job = engine.run(
            engine.prepare(tensors_of(q, k, v, q_cu, kv_cu), PrefillOptions()), loop=loop
        )
        settled = job.settled(timeout=60)
        assert isinstance(settled, asyncio.Future) and not isinstance(settled, asyncio.Task)
        assert len(asyncio.all_tasks()) == tasks_before
        result = await settled
        assert result.kernels == job.kernels
        assert_close_to_reference(q, k, v, q_cu, kv_cu, True, result.out)
        result.release()

    asyncio.run(main())


@pytest.mark.slow
def test_a_settled_future_past_its_deadline_fails_and_abandons_the_work(engine):
    """The deadline is a timer on the loop: past it the future fails with
    DeadlineExceededError and the job is cancelled; a future cancelled by its awaiter cancels
    the job too."""
    q, k, v, q_cu, kv_cu = _batch([3000], [3000], dtype=torch.float32)

    async def main():
        loop = asyncio.get_running_loop()
        slow = submit(engine, q, k, v, q_cu, kv_cu, kernel="reference", causal=False)
        settled = slow.settled(timeout=0.05)
        with pytest.raises(zen_mla.DeadlineExceededError, match=r"0\.05 s deadline"):
            await settled
        assert slow.done()
        other = engine.run(
            engine.prepare(tensors_of(q, k, v, q_cu, kv_cu), PrefillOptions(kernel="reference")),
            loop=loop,
        )
        waiter = asyncio.ensure_future(other.wait(timeout=60))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0)  # the future's callbacks run on the loop's next turn
        assert other.done()

    asyncio.run(main())
    deadline = time.monotonic() + 120
    while not engine.ready():
        assert time.monotonic() < deadline, engine.workers()
        time.sleep(0.05)
    assert submit(engine, *_batch([9], [9])).result(timeout=60).out.shape == (9, H, DV)
