"""The worker pool: spawned processes pinned to CCXs, fed pieces of ragged batches.

One dispatcher thread per worker sends it tasks, waits for the answer or the process's death,
pings it when idle, and replaces it when it dies. Work lost with a dead worker is retried once
on another; a job abandoned by its caller has its busy workers killed and replaced.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import send_handle
from pathlib import Path
from typing import Any

import torch

from .._errors import KernelError, PoolClosedError
from .._ragged import RaggedBatch, validate
from ..kernels import select_kernel
from ..topology import SYSFS, WorkerSlot, discover_ccxs, plan_workers
from . import _worker
from ._schedule import schedule
from ._shm import BufferCache, SharedBuffer, aligned, tensor_ref

__all__ = ["PoolConfig", "PoolJob", "PoolResult", "WorkerPool"]

log = logging.getLogger("zen_mla.pool")
_spawn = mp.get_context("spawn")
_env_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """workers: None for one per CCX; smt: also use SMT siblings; times in seconds."""

    workers: int | None = None
    smt: bool = False
    ping_interval: float = 1.0
    ping_timeout: float = 10.0
    start_timeout: float = 180.0
    cache_bytes: int = 1 << 30
    sysfs: Path = SYSFS


class PoolResult:
    """out `[Tq, H, Dv]` and lse `[H, Tq]` (or None) as views of shared memory.

    `release()` hands the memory back for reuse; the tensors must not be used after it. Without
    it the memory is simply freed once the tensors are.
    """

    def __init__(
        self,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        kernel: str,
        buffer: SharedBuffer,
        cache: BufferCache,
    ) -> None:
        self.out, self.lse, self.kernel = out, lse, kernel
        self._buffer: SharedBuffer | None = buffer
        self._cache = cache

    def release(self) -> None:
        if self._buffer is not None:
            self._cache.put(self._buffer)
            self._buffer = None


@dataclass(eq=False)
class _Task:
    """One worker's share of a job: its pieces, in one message."""

    id: int
    job: PoolJob
    spec: dict[str, Any]
    buffers: list[SharedBuffer]
    cost: int
    attempts: int = 0


@dataclass(eq=False)
class PoolJob:
    """A submitted batch. `result()` waits; `cancel()` abandons it (its busy workers are
    stopped and replaced, so their CCXs are free again at once)."""

    kernel: str
    _future: Future[PoolResult] = field(default_factory=Future)
    _pending: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _on_cancel: Any = None
    _finish: Any = None
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None

    def result(self, timeout: float | None = None) -> PoolResult:
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"the batch did not finish within {timeout} s") from None

    def done(self) -> bool:
        return self._future.done()

    @property
    def cancelled(self) -> bool:
        return self._future.cancelled()

    def cancel(self) -> None:
        on_cancel = self._on_cancel
        if self._future.cancel() and on_cancel is not None:
            on_cancel(self)

    def _piece_done(self) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last and self._finish is not None:
            self._finish(self)

    def _fail(self, exc: BaseException) -> None:
        # a race with cancel() or another failure: the first outcome wins
        with contextlib.suppress(InvalidStateError):
            self._future.set_exception(exc)


class _Worker:
    def __init__(self, slot: WorkerSlot) -> None:
        self.slot = slot
        self.process: Any = None
        self.conn: Connection | None = None
        self.queue: queue.Queue[_Task | None] = queue.Queue()
        self.current: _Task | None = None
        self.load = 0
        self.alive = False
        self.restarts = 0
        self.mapped: set[int] = set()  # buffer ids the process has mapped
        self.thread: threading.Thread | None = None


class WorkerPool:
    """Worker processes over the CCXs of the CPUs this process may use.

    `submit()` validates a ragged batch, splits it into pieces by cost and returns a `PoolJob`;
    inputs already in one of this pool's `SharedBuffer`s (see `buffer()`) are read in place,
    others are copied into shared memory once. Outputs land in shared memory.
    """

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        ccxs = discover_ccxs(self.config.sysfs)
        self.slots = plan_workers(ccxs, self.config.workers, smt=self.config.smt)
        self._workers = [_Worker(s) for s in self.slots]
        self._freed: set[int] = set()  # buffer ids freed here but still mapped by a worker
        self._freed_lock = threading.Lock()
        self._cache = BufferCache(self.config.cache_bytes, self._buffer_freed)
        self._ids = itertools.count(1)
        self._closing = False
        #: input bytes copied into shared memory because they came from ordinary memory
        self.staged_bytes = 0
        self._jobs: set[PoolJob] = set()
        self._lock = threading.Lock()
        from .._status import zentorch_status

        self._warm_zentorch = bool(zentorch_status()["ops"]["zentorch_sdpa"])

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> WorkerPool:
        """Spawn every worker and wait until each has loaded torch (in parallel)."""
        for w in self._workers:
            self._spawn(w)
        deadline = time.monotonic() + self.config.start_timeout
        for w in self._workers:
            self._await_ready(w, deadline)
        for w in self._workers:
            w.thread = threading.Thread(
                target=self._dispatch_loop,
                args=(w,),
                daemon=True,
                name=f"zen-mla-worker-{w.slot.id}",
            )
            w.thread.start()
        return self

    def __enter__(self) -> WorkerPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, grace: float = 10.0) -> None:
        """Refuse new work, let running jobs finish within `grace` seconds, fail the rest with
        PoolClosedError, stop the workers. Never hangs."""
        with self._lock:
            self._closing = True
            jobs = list(self._jobs)
        deadline = time.monotonic() + grace
        for job in jobs:
            with contextlib.suppress(Exception):
                job.result(max(0.0, deadline - time.monotonic()))
        for job in jobs:
            job._fail(PoolClosedError("the worker pool shut down before this batch finished"))
        for w in self._workers:
            w.queue.put(None)
            if w.current is not None and w.process is not None:
                w.process.kill()
        for w in self._workers:
            if w.thread is not None:
                w.thread.join(timeout=5)
            self._stop_process(w)
        self._cache.clear()

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's id, CPUs, threads, liveness, pid and restarts (for /health)."""
        return [
            {
                "id": w.slot.id,
                "cpus": list(w.slot.cpus),
                "threads": w.slot.threads,
                "alive": bool(w.alive and w.process is not None and w.process.is_alive()),
                "pid": w.process.pid if w.process is not None else None,
                "restarts": w.restarts,
            }
            for w in self._workers
        ]

    def _spawn(self, w: _Worker) -> None:
        parent, child = _spawn.Pipe(duplex=True)
        threads = w.slot.threads
        # The child's OpenMP runtime reads its environment when torch loads, which can happen
        # before our entry point runs (spawn re-imports the parent's __main__): hand it the
        # thread counts through the environment it is started with.
        with _env_lock:
            saved = {v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
            os.environ.update({v: str(threads) for v in saved})
            try:
                proc = _spawn.Process(
                    target=_worker.main,
                    args=(child, w.slot.cpus, threads, self._warm_zentorch),
                    name=f"zen-mla-worker-{w.slot.id}",
                    daemon=True,
                )
                proc.start()
            finally:
                for v, old in saved.items():
                    if old is None:
                        os.environ.pop(v, None)
                    else:
                        os.environ[v] = old
        child.close()
        w.process, w.conn, w.alive = proc, parent, False
        w.mapped = set()

    def _await_ready(self, w: _Worker, deadline: float) -> None:
        assert w.conn is not None
        ready = wait([w.conn, w.process.sentinel], max(0.0, deadline - time.monotonic()))
        if w.conn in ready:
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                msg = None
            if msg and msg[0] == "ready":
                w.alive = True
                return
        raise KernelError(f"worker {w.slot.id} on CPUs {list(w.slot.cpus)} did not start")

    def _stop_process(self, w: _Worker) -> None:
        w.alive = False
        if w.process is None:
            return
        if w.process.is_alive() and w.conn is not None:
            with contextlib.suppress(OSError):
                w.conn.send(("stop",))
            w.process.join(timeout=2)
        if w.process.is_alive():
            w.process.kill()
        w.process.join(timeout=5)
        if w.conn is not None:
            w.conn.close()
        w.process.close()
        w.process, w.conn = None, None

    def _replace(self, w: _Worker) -> None:
        log.warning(
            "worker %d (pid %s) died; replacing it", w.slot.id, w.process.pid if w.process else None
        )
        self._stop_process(w)
        w.restarts += 1
        while not self._closing:
            try:
                self._spawn(w)
                self._await_ready(w, time.monotonic() + self.config.start_timeout)
                return
            except KernelError:
                self._stop_process(w)
                time.sleep(1.0)

    # -- dispatch ----------------------------------------------------------------------------

    def _dispatch_loop(self, w: _Worker) -> None:
        pings = itertools.count()
        while True:
            try:
                task = w.queue.get(timeout=self.config.ping_interval)
            except queue.Empty:
                if not self._closing and not self._ping(w, next(pings)):
                    self._replace(w)
                continue
            if task is None:
                return
            w.load -= task.cost
            if task.job.done():
                continue  # cancelled or failed while queued
            w.current = task
            outcome = self._run_on(w, task)
            w.current = None
            if outcome is None:  # the process died under the task
                if not self._closing:
                    self._replace(w)
                self._lost(task, w)
            elif outcome[0] == "done":
                task.job._piece_done()
            else:
                task.job._fail(KernelError(f"worker {w.slot.id}: {outcome[2]}: {outcome[3]}"))

    def _run_on(self, w: _Worker, task: _Task) -> tuple[Any, ...] | None:
        conn, proc = w.conn, w.process
        if conn is None or proc is None:
            return None
        if task.job.started_at is None:
            task.job.started_at = time.perf_counter()
        with self._freed_lock:
            forget = w.mapped & self._freed
            w.mapped -= forget
            self._freed -= {i for i in forget if not any(i in o.mapped for o in self._workers)}
        fresh = [b for b in task.buffers if b.id not in w.mapped]
        spec = {
            **task.spec,
            "buffers": [(b.id, b.nbytes, b in fresh) for b in task.buffers],
            "forget": sorted(forget),
        }
        try:
            conn.send(("run", task.id, spec))
            for buf in fresh:
                send_handle(conn, buf.fd, proc.pid)
                w.mapped.add(buf.id)
            while True:
                ready = wait([conn, proc.sentinel])
                if conn in ready:
                    msg: tuple[Any, ...] = conn.recv()
                    if msg[0] in ("done", "error") and msg[1] == task.id:
                        return msg
                elif proc.sentinel in ready:
                    return None
        except (EOFError, OSError):
            return None

    def _ping(self, w: _Worker, n: int) -> bool:
        conn, proc = w.conn, w.process
        if conn is None or proc is None or not proc.is_alive():
            return False
        try:
            conn.send(("ping", n))
            deadline = time.monotonic() + self.config.ping_timeout
            while time.monotonic() < deadline:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    msg = conn.recv()
                    if msg == ("pong", n):
                        return True
            return False
        except (EOFError, OSError):
            return False

    def _lost(self, task: _Task, dead: _Worker) -> None:
        if task.job.done():
            return  # abandoned or already failed: nothing to redo
        task.attempts += 1
        if task.attempts >= 2 or self._closing:
            task.job._fail(
                KernelError(
                    f"a worker process died twice running this batch (last: worker {dead.slot.id})"
                )
            )
            return
        others = [w for w in self._workers if w is not dead and w.alive] or [dead]
        self._enqueue(min(others, key=lambda w: w.load), task)

    def _enqueue(self, w: _Worker, task: _Task) -> None:
        w.load += task.cost
        w.queue.put(task)

    def _cancel(self, job: PoolJob) -> None:
        for w in self._workers:
            task = w.current
            if task is not None and task.job is job and w.process is not None:
                w.process.kill()  # the dispatcher sees the death and replaces the worker

    # -- submission --------------------------------------------------------------------------

    def buffer(self, nbytes: int) -> SharedBuffer:
        """Shared memory for the caller to fill (say, a request body read from a socket);
        tensors viewing it are passed to `submit()` with `inputs=` and read in place."""
        return self._cache.get(nbytes)

    def release(self, buf: SharedBuffer) -> None:
        self._cache.put(buf)

    def submit(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_cu_seq_lens: torch.Tensor,
        kv_cu_seq_lens: torch.Tensor | None = None,
        *,
        causal: bool = True,
        return_lse: bool = False,
        scale: float | None = None,
        kernel: str = "auto",
        inputs: SharedBuffer | None = None,
    ) -> PoolJob:
        """Validate and queue a ragged batch (arguments as `zen_mla.ragged_attention`)."""
        if self._closing:
            raise PoolClosedError("the worker pool is shut down")
        batch = validate(q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal=causal, scale=scale)
        chosen = select_kernel(kernel, batch.q.dtype, return_lse=return_lse)
        return self.submit_batch(batch, chosen.name, return_lse=return_lse, inputs=inputs)

    def submit_batch(
        self,
        batch: RaggedBatch,
        kernel: str,
        *,
        return_lse: bool,
        inputs: SharedBuffer | None = None,
    ) -> PoolJob:
        """Queue a validated batch with a selected kernel name."""
        if self._closing:
            raise PoolClosedError("the worker pool is shut down")
        tq, h, _ = batch.q.shape
        dv = batch.v_head_dim
        out_bytes = aligned(tq * h * dv * batch.v.element_size())
        out_buf = self._cache.get(out_bytes + (h * tq * 4 if return_lse else 0))
        out = out_buf.tensor(0, (tq, h, dv), batch.v.dtype)
        lse = out_buf.tensor(out_bytes, (h, tq), torch.float32) if return_lse else None

        tensors = (batch.q, batch.k, batch.v)
        staging: SharedBuffer | None = None
        if inputs is not None and all(inputs.contains(t) for t in tensors):
            src = inputs
        else:
            # Inputs from ordinary memory: one copy into shared memory is unavoidable here.
            sizes = [aligned(t.numel() * t.element_size()) for t in tensors]
            staging = src = self._cache.get(sum(sizes))
            self.staged_bytes += sum(sizes)
            offset, staged = 0, []
            for t, size in zip(tensors, sizes, strict=True):
                dst = src.tensor(offset, tuple(t.shape), t.dtype)
                dst.copy_(t)
                staged.append(dst)
                offset += size
            tensors = (staged[0], staged[1], staged[2])

        job = PoolJob(kernel=kernel)
        buffers = [src, out_buf]
        common = {
            "kernel": kernel,
            "causal": batch.causal,
            "scale": batch.scale,
            "q": tensor_ref(src, tensors[0]),
            "k": tensor_ref(src, tensors[1]),
            "v": tensor_ref(src, tensors[2]),
            "out": tensor_ref(out_buf, out),
            "lse": tensor_ref(out_buf, lse) if lse is not None else None,
        }
        plan = schedule(
            batch.q_cu_seq_lens, batch.kv_cu_seq_lens, h, batch.causal, len(self._workers)
        )
        tasks = [
            _Task(
                next(self._ids),
                job,
                {**common, "pieces": pieces},
                buffers,
                sum(p.cost for p in pieces),
            )
            for pieces in plan
            if pieces
        ]

        def finish(j: PoolJob) -> None:
            if staging is not None:
                self._cache.put(staging)
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                j._future.set_result(PoolResult(out, lse, kernel, out_buf, self._cache))

        job._pending = len(tasks)
        job._finish, job._on_cancel = finish, self._cancel
        if not tasks:
            finish(job)
            return job
        with self._lock:
            if self._closing:
                raise PoolClosedError("the worker pool is shut down")
            self._jobs.add(job)
        # the plan's i-th share goes to the least-loaded worker, biggest share first
        for task in sorted(tasks, key=lambda t: -t.cost):
            self._enqueue(min(self._workers, key=lambda w: w.load), task)
        job._future.add_done_callback(lambda _: self._forget(job))
        return job

    def _buffer_freed(self, buf_id: int) -> None:
        with self._freed_lock:
            if any(buf_id in w.mapped for w in self._workers):
                self._freed.add(buf_id)

    def _forget(self, job: PoolJob) -> None:
        with self._lock:
            self._jobs.discard(job)
        # drop the closures holding the job's shared buffers: freed now, not at the next gc
        job._finish = job._on_cancel = None

    def run(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> PoolResult:
        """`submit(...)` and wait; on timeout the job is abandoned and TimeoutError raised."""
        job = self.submit(*args, **kwargs)
        try:
            return job.result(timeout)
        except (TimeoutError, CancelledError):
            job.cancel()
            raise
