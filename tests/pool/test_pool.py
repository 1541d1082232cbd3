"""The worker pool with real spawned processes on this machine's CPUs."""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import zen_mla
from tests.batches import BATCH_SPECS, BatchSpec, make_batch
from tests.pool.jobs import run, submit
from tests.processes import open_fds
from tests.reference import assert_close_to_reference
from zen_mla.pool import PoolConfig, WorkerPool
from zen_mla.pool._messages import RunTask, TaskSpec

CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs for two workers")


def _cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


@pytest.fixture(scope="module")
def pool():
    # min_piece_cost=1: the small test batches are split as a large one would be
    workers = 2 if len(CPUS) >= 2 else 1
    config = PoolConfig(workers=workers, heartbeat_interval=0.2, min_piece_cost=1)
    with WorkerPool(config) as p:
        yield p


def _wait_all_alive(pool: WorkerPool, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(w["alive"] for w in pool.workers()):
            return
        time.sleep(0.1)
    raise AssertionError(f"workers not all alive: {pool.workers()}")


@needs_two_cpus
def test_workers_are_pinned_to_disjoint_cpus(pool):
    workers = pool.workers()
    assert len(workers) == 2 and all(w["alive"] for w in workers)
    allowed = [_cpus_allowed(w["pid"]) for w in workers]
    assert allowed == [str(w["cpus"][0]) for w in workers]
    assert allowed[0] != allowed[1]
    assert all(w["threads"] == 1 for w in workers)


@pytest.mark.parametrize(
    "kernel",
    [
        pytest.param("native", marks=pytest.mark.native),
        pytest.param("zentorch", marks=pytest.mark.zentorch),
        "torch",
    ],
)
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("spec", BATCH_SPECS.values(), ids=BATCH_SPECS.keys())
def test_results_equal_in_process(pool, spec, return_lse, kernel):
    q, k, v, q_cu, kv_cu = make_batch(spec, (4, 192, 128), torch.bfloat16)
    want = zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, return_lse=return_lse, kernel=kernel)
    result = run(pool, q, k, v, q_cu, kv_cu, return_lse=return_lse, kernel=kernel)
    try:
        if return_lse:
            assert torch.equal(result.out, want[0])
            assert torch.equal(result.lse, want[1])
        else:
            assert torch.equal(result.out, want)
            assert result.lse is None
        want_kernel = zen_mla.kernel_choice(kernel, q.dtype, return_lse=return_lse).out
        assert result.kernel == want_kernel
    finally:
        result.release()


def _record_tasks(pool: WorkerPool, monkeypatch: pytest.MonkeyPatch) -> list[TaskSpec]:
    """The spec of every task sent to a worker from now on: where each tensor it reads lies."""
    specs: list[TaskSpec] = []
    for d in pool._dispatchers:
        real = d.proc.send

        def recording(msg, fds=(), real=real):
            if isinstance(msg, RunTask):
                specs.append(msg.spec)
            return real(msg, fds)

        monkeypatch.setattr(d.proc, "send", recording)
    return specs


def test_inputs_in_a_shared_buffer_are_read_in_place(pool, monkeypatch):
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (4, 192, 128), torch.bfloat16)
    buf = pool.buffer(q.nbytes + k.nbytes + v.nbytes)
    sq = buf.tensor(0, q.shape, q.dtype)
    sk = buf.tensor(q.nbytes, k.shape, k.dtype)
    sv = buf.tensor(q.nbytes + k.nbytes, v.shape, v.dtype)
    sq.copy_(q), sk.copy_(k), sv.copy_(v)
    sent = _record_tasks(pool, monkeypatch)
    result = run(pool, sq, sk, sv, q_cu, kernel="torch", inputs=buf)
    assert sent
    for spec in sent:  # the workers read q, k and v where they lie in `buf`
        for ref, t in zip((spec.q, spec.k, spec.v), (sq, sk, sv), strict=True):
            assert (ref.buffer, ref.offset) == (buf.id, t.data_ptr() - buf.base), "nothing copied"
    assert torch.equal(result.out, zen_mla.ragged_attention(q, k, v, q_cu, kernel="torch"))
    result.release()
    pool.release(buf)
    sent.clear()
    run(pool, q, k, v, q_cu, kernel="torch").release()  # from ordinary memory: one copy
    assert sent
    for spec in sent:  # copies of q, k and v one after another in one buffer of the pool's
        assert spec.q.buffer == spec.k.buffer == spec.v.buffer != buf.id
        assert spec.q.offset == 0 and spec.k.offset >= q.nbytes
        assert spec.v.offset >= spec.k.offset + k.nbytes


def test_bad_input_is_refused_before_any_worker_sees_it(pool):
    q = torch.randn(4, 2, 8)
    with pytest.raises(zen_mla.InvalidInputError, match="q_cu_seq_lens"):
        submit(pool, q, q, q, torch.tensor([0, 5]))
    assert all(w["alive"] for w in pool.workers())


@pytest.mark.slow
def test_sigkill_mid_batch_is_retried_and_the_pool_heals(pool):
    big = torch.randn(3000, 8, 192).bfloat16()
    big_v = torch.randn(3000, 8, 128).bfloat16()
    cu = torch.tensor([0, 3000])
    want = zen_mla.ragged_attention(big, big, big_v, cu, kernel="reference")
    restarts = sum(w["restarts"] for w in pool.workers())
    job = submit(pool, big, big, big_v, cu, kernel="reference")
    deadline = time.monotonic() + 30
    while not any(w["state"] == "busy" for w in pool.workers()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    victim = next(w for w in pool.workers() if w["state"] == "busy")
    os.kill(victim["pid"], signal.SIGKILL)
    result = job.result(120)
    # fp32 matmuls reduce in another order on 1 thread than on 2: equal up to bf16 rounding
    torch.testing.assert_close(result.out, want, atol=1.6e-2, rtol=1.6e-2)
    result.release()
    _wait_all_alive(pool)
    assert sum(w["restarts"] for w in pool.workers()) == restarts + 1


@pytest.mark.slow
def test_abandoned_job_frees_its_workers(pool):
    big = torch.randn(4000, 8, 192).bfloat16()
    cu = torch.tensor([0, 4000])
    job = submit(pool, big, big, big[..., :128], cu, kernel="reference")
    while not any(w.current is not None for w in pool._dispatchers):
        time.sleep(0.01)
    busy = sum(w.current is not None for w in pool._dispatchers)
    restarts = sum(w["restarts"] for w in pool.workers())
    t0 = time.monotonic()
    job.cancel()
    assert job.cancelled
    while sum(w["restarts"] for w in pool.workers()) < restarts + busy:
        assert time.monotonic() - t0 < 30, "busy workers are stopped and replaced"
        time.sleep(0.05)
    _wait_all_alive(pool)
    assert time.monotonic() - t0 < 30
    assert all(w.current is None for w in pool._dispatchers)
    small = make_batch(BATCH_SPECS["ragged"], (2, 64, 64), torch.float32)
    run(pool, *small, timeout=60).release()  # the pool serves again


@pytest.mark.slow
def test_shutdown_with_work_in_flight_never_hangs():
    fds, shm = open_fds(), set(os.listdir("/dev/shm"))
    p = WorkerPool(PoolConfig(workers=1)).start()
    big = torch.randn(6000, 8, 192).bfloat16()
    cu = torch.tensor([0, 6000])
    jobs = [submit(p, big, big, big, cu, causal=False, kernel="reference") for _ in range(3)]
    t0 = time.monotonic()
    p.close(grace=0.5)
    assert time.monotonic() - t0 < 20
    closed = 0
    for job in jobs:
        assert job.done()
        try:
            job.result(0).release()  # finished within the grace period
        except zen_mla.PoolClosedError:
            closed += 1
    assert closed >= 2, "three jobs of seconds each cannot all finish in 0.5 s"
    with pytest.raises(zen_mla.PoolClosedError):
        submit(p, big, big, big, cu)
    del jobs
    gc.collect()
    assert set(os.listdir("/dev/shm")) <= shm, "no /dev/shm segment left behind"
    assert open_fds() <= fds + 1, "no descriptors left open"


def test_no_shared_memory_or_descriptor_leaks_over_many_batches(pool):
    q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS["prefix_cached"], (4, 192, 128), torch.bfloat16)
    run(pool, q, k, v, q_cu, kv_cu).release()
    fds, shm = open_fds(), set(os.listdir("/dev/shm"))
    for _ in range(30):
        run(pool, q, k, v, q_cu, kv_cu, return_lse=True).release()
    assert open_fds() <= fds + 2  # the buffer cache may hold a couple more
    assert set(os.listdir("/dev/shm")) <= shm


def _memfd_mappings(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-2] for line in maps if "memfd:zen-mla-" in line}


def test_workers_unmap_buffers_the_supervisor_frees(pool):
    for n in range(1, 25):  # a new size each time: buffers come and go
        q, k, v, q_cu, _ = make_batch(BatchSpec([n * 40]), (2, 64, 64), torch.float32, seed=n)
        run(pool, q, k, v, q_cu).release()
    pool._cache.clear()
    gc.collect()
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 64), torch.float32)
    for _ in range(2 * len(pool.workers())):  # every worker gets a task carrying its forgets
        run(pool, q, k, v, q_cu).release()
    for w in pool.workers():
        assert len(_memfd_mappings(w["pid"])) <= 6, "freed buffers stay mapped"


def test_inputs_in_an_odd_sized_buffer(pool):
    """A request body can have any length; tensors inside it are still read in place."""
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 32), torch.bfloat16)
    buf = pool.buffer(q.nbytes + k.nbytes + v.nbytes + 1)
    tensors = []
    offset = 0
    for t in (q, k, v):
        tensors.append(buf.tensor(offset, t.shape, t.dtype).copy_(t))
        offset += t.nbytes
    result = run(pool, *tensors, q_cu, kernel="torch", inputs=buf)
    assert torch.equal(result.out, zen_mla.ragged_attention(q, k, v, q_cu, kernel="torch"))
    result.release()
    pool.release(buf)


@pytest.mark.parametrize("kernel", ["torch", "reference"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("spec", BATCH_SPECS.values(), ids=BATCH_SPECS.keys())
def test_requests_split_by_queries_too(pool, spec, causal, kernel):
    """With 2 heads and 2 workers, a request over half a share needs 4 pieces: 2 head groups x
    2 query blocks, each a bottom-right causal request of its own."""
    q, k, v, q_cu, kv_cu = make_batch(spec, (2, 64, 48), torch.bfloat16)
    result = run(pool, q, k, v, q_cu, kv_cu, causal=causal, return_lse=True, kernel=kernel)
    try:
        assert_close_to_reference(q, k, v, q_cu, kv_cu, causal, result.out, result.lse)
    finally:
        result.release()


def test_query_blocks_cover_every_row_once():
    from zen_mla.pool._schedule import schedule

    q_cu, kv_cu = (0, 37, 37, 1037, 1100), (0, 50, 60, 1060, 1100)
    for causal in (True, False):
        for workers in (2, 3, 12):
            plan = schedule(q_cu, kv_cu, 2, causal, workers)
            covered = torch.zeros(1100, 2, dtype=torch.int32)
            for piece in (p for mine in plan for p in mine):
                covered[piece.q_lo : piece.q_hi, piece.h0 : piece.h1] += 1
            # rows of requests that see keys are covered once; request 1 has no queries
            assert covered.max() == 1 and covered.sum() == 1100 * 2


def test_a_small_call_is_not_split():
    """Below the smallest piece worth a hop a call runs whole on one worker; with one worker
    nothing is split (its pieces would run one after another, each a kernel call)."""
    from zen_mla.pool._schedule import schedule

    one_token = schedule((0, 1), (0, 1), 16, True, 2, PoolConfig().min_piece_cost)
    assert sorted(len(mine) for mine in one_token) == [0, 1]
    small_batch = schedule((0, 8, 16, 24), (0, 8, 16, 24), 16, True, 2, 1 << 17)
    assert sorted(len(mine) for mine in small_batch) == [0, 1]
    assert [(p.r0, p.r1, p.h0, p.h1) for p in max(small_batch, key=len)] == [(0, 3, 0, 16)]
    long_request = schedule((0, 4096), (0, 4096), 16, True, 1, 1)
    assert [(p.h0, p.h1, p.q_lo, p.q_hi) for p in long_request[0]] == [(0, 16, 0, 4096)]
    # the same request over two workers is split, into pieces of at least the minimum
    split = schedule((0, 4096), (0, 4096), 16, True, 2, 1 << 17)
    pieces = [p for mine in split for p in mine]
    assert all(mine for mine in split) and len(pieces) >= 2
    assert min(p.cost for p in pieces) >= 1 << 17


@pytest.mark.slow
def test_workers_spin_as_openmp_does_whatever_the_parents_wait_policy(monkeypatch):
    """A parent that keeps its own OpenMP threads from spinning (OMP_WAIT_POLICY=PASSIVE, as
    the benchmarks do) does not make every small call wake the workers' threads from sleep."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with WorkerPool(PoolConfig(workers=1)) as p:
        pid = p.workers()[0]["pid"]
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not any(e.startswith(b"OMP_WAIT_POLICY=") for e in env)
    assert any(e.startswith(b"OMP_NUM_THREADS=") for e in env)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # the parent's own is left as it was
