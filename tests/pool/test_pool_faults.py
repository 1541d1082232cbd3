"""The pool under faults: empty tensors, no descriptors left, failed sends, its own bugs, stopped
and orphaned workers."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import zen_mla
from tests.batches import DTYPES, EMPTY_SPECS, BatchSpec, make_batch
from tests.pool.jobs import run, submit
from tests.reference import assert_close_to_reference
from zen_mla.pool import PoolConfig, WorkerPool

CPUS = sorted(os.sched_getaffinity(0))
ROOT = Path(__file__).resolve().parents[2]
#: the pool's reference kernel runs on 1 thread here, the in-process one on all: fp32 sums in
#: another order, so outputs may differ by a rounding step of their dtype
ATOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def pool():
    config = PoolConfig(workers=min(2, len(CPUS)), heartbeat_interval=0.2, min_piece_cost=1)
    with WorkerPool(config) as p:
        yield p


def _busy(pool: WorkerPool, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [w for w in pool.workers() if w["state"] == "busy"]
        if busy:
            return busy[0]
        time.sleep(0.01)
    raise AssertionError(f"no worker became busy: {pool.workers()}")


def _wait_all_alive(pool: WorkerPool, timeout: float = 60) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(w["alive"] for w in pool.workers()):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"workers not all alive: {pool.workers()}")


def _slow_batch(tokens: int = 4000, heads: int = 4):
    """Non-causal fp32 reference work of seconds on one core of this machine."""
    x = torch.randn(tokens, heads, 128)
    return x, x, x, torch.tensor([0, tokens])


# -- empty tensors ---------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("spec", EMPTY_SPECS.values(), ids=EMPTY_SPECS.keys())
def test_empty_tensors_as_in_process(pool, spec, dtype, return_lse, causal):
    q, k, v, q_cu, kv_cu = make_batch(spec, (2, 16, 8), dtype)
    want = zen_mla.ragged_attention(
        q, k, v, q_cu, kv_cu, causal=causal, return_lse=return_lse, kernel="reference"
    )
    want_out, want_lse = want if return_lse else (want, None)
    result = run(
        pool,
        q,
        k,
        v,
        q_cu,
        kv_cu,
        causal=causal,
        return_lse=return_lse,
        kernel="reference",
        timeout=60,
    )
    try:
        assert result.out.shape == want_out.shape and result.out.dtype == dtype
        torch.testing.assert_close(result.out, want_out, atol=ATOL[dtype], rtol=ATOL[dtype])
        if return_lse:
            assert result.lse is not None and result.lse.shape == want_lse.shape
            torch.testing.assert_close(result.lse, want_lse, atol=1e-4, rtol=1e-4)
        else:
            assert result.lse is None
        assert_close_to_reference(q, k, v, q_cu, kv_cu, causal, result.out, result.lse)
    finally:
        result.release()


# -- descriptors -----------------------------------------------------------------------------


@contextlib.contextmanager
def descriptors_exhausted() -> Iterator[int]:
    """Hold every descriptor this process may open until the block ends (the soft limit is
    lowered to just above those open, so that takes a few dozen); yields how many are held."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 32, hard))
    held: list[int] = []
    try:
        for _ in range(highest + 32):
            try:
                held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        with pytest.raises(OSError) as none_left:
            os.memfd_create("probe")
        assert none_left.value.errno == errno.EMFILE
        yield len(held)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _identities(pool: WorkerPool) -> list[tuple[int | None, int]]:
    return [(w["pid"], w["restarts"]) for w in pool.workers()]


def test_out_of_descriptors_work_is_sent_and_no_worker_dies(pool):
    """Buffers new to the workers go out with their descriptors while this process has none
    left; new shared memory is refused as 'try again'; the workers are the same ones after."""
    q, k, v, q_cu, _ = make_batch(BatchSpec([300, 200]), (2, 64, 64), torch.float32, seed=3)
    before = _identities(pool)
    buf = pool.buffer(q.nbytes + k.nbytes + v.nbytes)  # new: no worker has mapped it
    inputs = [buf.tensor(0, q.shape, q.dtype).copy_(q)]
    inputs.append(buf.tensor(q.nbytes, k.shape, k.dtype).copy_(k))
    inputs.append(buf.tensor(q.nbytes + k.nbytes, v.shape, v.dtype).copy_(v))
    pool.release(pool.buffer(q.nbytes))  # a new buffer of the output's size, in the cache
    with descriptors_exhausted():
        job = submit(pool, *inputs, q_cu, kernel="reference", inputs=buf)
        result = job.result(60)
        with pytest.raises(zen_mla.ServiceUnavailableError, match="shared memory"):
            pool.buffer(1 << 20)
        with pytest.raises(zen_mla.ServiceUnavailableError, match="shared memory"):
            submit(pool, q, k, v, q_cu, kernel="reference")  # needs a staging buffer
    assert_close_to_reference(q, k, v, q_cu, None, True, result.out)
    result.release()
    pool.release(buf)
    assert _identities(pool) == before and all(w["alive"] for w in pool.workers())
    run(pool, q, k, v, q_cu, kernel="reference", timeout=60).release()


@pytest.mark.slow
def test_a_replacement_is_retried_until_descriptors_return(pool, caplog):
    caplog.set_level(logging.WARNING, logger="zen_mla.pool")
    q, k, v, q_cu = _slow_batch(500)
    victim = pool.workers()[0]
    with descriptors_exhausted():
        os.kill(victim["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        while pool.workers()[0]["alive"]:  # until the signal has landed
            assert time.monotonic() - t0 < 5
            time.sleep(0.01)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2:  # 0.1 + 0.2 + 0.4 + 0.8 s of backoff: 4 attempts
            state = pool.workers()[0]
            assert state["alive"] is False, state
            time.sleep(0.05)
    freed = time.monotonic()
    took = _wait_all_alive(pool, timeout=60)
    result = run(pool, q, k, v, q_cu, causal=False, kernel="reference", timeout=60)
    result.release()
    served = time.monotonic() - freed
    failures = [r for r in caplog.records if "could not spawn a replacement" in r.getMessage()]
    assert len(failures) >= 2, "every failed attempt is logged"
    assert pool.workers()[0]["pid"] != victim["pid"]
    print(f"replaced {took:.2f} s and served {served:.2f} s after descriptors were freed")
    assert served < 30


def test_a_failed_send_fails_the_work_not_the_worker(pool, monkeypatch):
    from zen_mla.pool._messages import RunTask
    from zen_mla.pool._process import SendFailedError

    q, k, v, q_cu, _ = make_batch(BatchSpec([40, 30]), (2, 64, 64), torch.float32)
    before = _identities(pool)
    sends = []
    for w in pool._dispatchers:
        real = w.proc.send

        def failing(msg, fds=(), real=real):
            if isinstance(msg, RunTask):
                sends.append(msg.task_id)
                raise SendFailedError("No buffer space available (errno 105)")
            return real(msg, fds)

        monkeypatch.setattr(w.proc, "send", failing)
    with pytest.raises(zen_mla.ServiceUnavailableError, match="No buffer space"):
        run(pool, q, k, v, q_cu, kernel="reference", timeout=30)
    assert sends
    monkeypatch.undo()
    assert _identities(pool) == before and all(w["alive"] for w in pool.workers())
    result = run(pool, q, k, v, q_cu, kernel="reference", timeout=30)
    assert_close_to_reference(q, k, v, q_cu, None, True, result.out)
    result.release()


def test_the_dispatcher_survives_its_own_errors(pool, monkeypatch):
    q, k, v, q_cu, _ = make_batch(BatchSpec([40, 30]), (2, 64, 64), torch.float32)
    calls = []
    for w in pool._dispatchers:

        def broken(*args, real=w._run_on):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug")
            return real(*args)

        monkeypatch.setattr(w, "_run_on", broken)
    with pytest.raises(zen_mla.KernelError, match="a bug"):
        run(pool, q, k, v, q_cu, kernel="reference", timeout=30)
    assert all(w.thread is not None and w.thread.is_alive() for w in pool._dispatchers)
    run(pool, q, k, v, q_cu, kernel="reference", timeout=30).release()  # served again


@pytest.mark.slow
@pytest.mark.skipif(len(CPUS) < 2, reason="needs two workers")
def test_lost_work_is_retried_before_the_replacement_starts(pool, monkeypatch):
    """The other worker redoes the lost piece at once; it does not wait for the respawn (made
    to take 8 s here)."""
    real = pool._new_process

    def slow_start(slot):
        time.sleep(8)
        return real(slot)

    monkeypatch.setattr(pool, "_new_process", slow_start)
    q, k, v, q_cu = _slow_batch(2000)
    want = zen_mla.ragged_attention(q, k, v, q_cu, causal=False, kernel="reference")
    job = submit(pool, q, k, v, q_cu, causal=False, kernel="reference")
    victim = _busy(pool)
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    result = job.result(60)
    took = time.monotonic() - killed
    states = {w["id"]: w["state"] for w in pool.workers()}
    torch.testing.assert_close(result.out, want, atol=1e-5, rtol=1e-5)
    result.release()
    print(f"batch done {took:.2f} s after the kill")
    assert states[victim["id"]] == "starting", "finished while the replacement was starting"
    monkeypatch.undo()
    _wait_all_alive(pool)


# -- stopped workers -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_stopped_busy_worker_is_reported_and_left_to_resume():
    config = PoolConfig(workers=1, heartbeat_interval=0.2, heartbeat_timeout=1.5)
    with WorkerPool(config) as pool:
        q, k, v, q_cu = _slow_batch(5000)
        job = submit(pool, q, k, v, q_cu, causal=False, kernel="reference")
        worker = _busy(pool)
        os.kill(worker["pid"], signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while pool.workers()[0]["alive"]:
                assert time.monotonic() - stopped < 10, pool.workers()
                time.sleep(0.05)
            noticed = time.monotonic() - stopped
            state = pool.workers()[0]
            assert state["state"] == "stuck" and state["pid"] == worker["pid"], state
            time.sleep(1.0)
            assert pool.workers()[0]["state"] == "stuck" and not job.done()
        finally:
            os.kill(worker["pid"], signal.SIGCONT)
        result = job.result(120)
        assert_close_to_reference(q, k, v, q_cu, None, False, result.out)
        result.release()
        state = pool.workers()[0]
        assert state["alive"] and state["pid"] == worker["pid"] and state["restarts"] == 0
        print(f"stopped worker reported after {noticed:.2f} s")


@pytest.mark.slow
def test_a_stopped_idle_worker_is_replaced():
    """Idle, it holds no work: silent for heartbeat_timeout, it is killed and replaced."""
    config = PoolConfig(workers=1, heartbeat_interval=0.2, heartbeat_timeout=1.5)
    with WorkerPool(config) as pool:
        worker = pool.workers()[0]
        os.kill(worker["pid"], signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while pool.workers()[0]["alive"]:
                assert time.monotonic() - stopped < 10, pool.workers()
                time.sleep(0.05)
            assert time.monotonic() - stopped >= config.heartbeat_timeout
            _wait_all_alive(pool)
            took = time.monotonic() - stopped
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker["pid"], signal.SIGCONT)
        now = pool.workers()[0]
        assert now["pid"] != worker["pid"] and now["restarts"] == 1, now
        assert wait_gone(worker["pid"], 5) is not None
        q, k, v, q_cu, _ = make_batch(BatchSpec([20]), (2, 64, 64), torch.float32)
        run(pool, q, k, v, q_cu, kernel="reference", timeout=60).release()
        print(f"stopped idle worker replaced within {took:.2f} s")


# -- orphans ---------------------------------------------------------------------------------

ORPHAN_SCRIPT = """
import os, signal, sys, time
import torch
from tests.pool.jobs import submit
from zen_mla.pool import PoolConfig, WorkerPool

pool = WorkerPool(PoolConfig(workers=1, heartbeat_interval=0.2)).start()
if sys.argv[1] == "replaced":  # the worker to orphan is a replacement
    first = pool.workers()[0]["pid"]
    os.kill(first, signal.SIGKILL)
    for _ in range(600):
        w = pool.workers()[0]
        if w["alive"] and w["pid"] != first:
            break
        time.sleep(0.1)
x = torch.randn(8000, 4, 128)
job = submit(pool, x, x, x, torch.tensor([0, 8000]), causal=False, kernel="reference")
for _ in range(3000):
    if pool.workers()[0]["state"] == "busy":
        break
    time.sleep(0.01)
print(pool.workers()[0]["pid"], flush=True)
time.sleep(300)
"""


def gone(pid: int) -> bool:
    """No such process, or a zombie (PID 1 here may not reap what it inherits)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_gone(pid: int, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if gone(pid):
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["first", "replaced"])
def test_a_busy_worker_dies_with_its_parent(worker):
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_SCRIPT, worker], cwd=ROOT, stdout=subprocess.PIPE
    )
    pid = 0
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert not gone(pid)
        parent.kill()
        parent.wait(10)
        took = wait_gone(pid, 5)
        print(f"orphaned {worker} worker gone after {took} s")
        assert took is not None and took < 1.5, f"worker {pid} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()
        if pid and not gone(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_workers_outlive_the_thread_that_started_them():
    """Workers die with the thread that spawned them (PR_SET_PDEATHSIG): a pool started from a
    thread that then exits must keep its workers."""
    box: dict[str, WorkerPool] = {}

    def start() -> None:
        box["pool"] = WorkerPool(PoolConfig(workers=1, heartbeat_interval=0.2)).start()

    t = threading.Thread(target=start)
    t.start()
    t.join(180)
    pool = box["pool"]
    try:
        pid = pool.workers()[0]["pid"]
        time.sleep(1.0)
        assert not gone(pid) and pool.workers()[0]["alive"]
        q, k, v, q_cu, _ = make_batch(BatchSpec([20]), (2, 64, 64), torch.float32)
        run(pool, q, k, v, q_cu, kernel="reference", timeout=60).release()
        assert pool.workers()[0]["pid"] == pid
    finally:
        pool.close()
