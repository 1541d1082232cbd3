"""The worker pool: spawned processes pinned to CCXs, fed pieces of ragged batches.

One dispatcher thread per worker sends it tasks, waits for the answer, the process's death or
its silence (workers send a heartbeat from a thread of their own), and replaces a worker that
dies, retrying with backoff until a replacement starts. Work lost with a dead worker is retried
once on another; a job abandoned by its caller has its busy workers killed and replaced. Failing
to send work (no memory or buffer space) fails that work, never the worker.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from .._errors import KernelError, PoolClosedError, ServiceUnavailableError
from .._ragged import RaggedBatch, validate
from ..kernels import select_kernel
from ..topology import SYSFS, WorkerSlot, discover_ccxs, plan_workers
from ._process import SendFailedError, WorkerGoneError, WorkerProcess, start_until_ready
from ._schedule import schedule
from ._shm import BufferCache, SharedBuffer, aligned, tensor_ref

__all__ = ["PoolConfig", "PoolJob", "PoolResult", "WorkerPool"]

log = logging.getLogger("zen_mla.pool")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """workers: None for one per CCX; smt: also use SMT siblings; times in seconds.

    Workers send a heartbeat every `ping_interval`; one silent for `ping_timeout` is "stuck":
    reported not alive while busy (its work is left to finish or be abandoned), replaced while
    idle.
    """

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
    """One CCX's worker as the pool sees it. Its dispatcher thread owns every field and is the
    only one to replace `proc`; `lock` guards `proc`, `state`, `current` and `restarts` against
    readers in other threads (`workers()`, `cancel()`, `close()`). `WorkerPool._load_lock`
    guards `load`, `WorkerPool._freed_lock` guards `mapped`."""

    def __init__(self, slot: WorkerSlot) -> None:
        self.slot = slot
        self.proc: WorkerProcess | None = None
        self.state = "starting"  # starting | idle | busy | stuck | stopped
        self.queue: queue.Queue[_Task | None] = queue.Queue()
        self.current: _Task | None = None
        self.load = 0
        self.restarts = 0
        self.mapped: set[int] = set()  # buffer ids the process has mapped
        self.heard_at = 0.0  # time.monotonic() of the process's last message
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """Can take work now (read without the lock: a hint for placing work)."""
        return self.state in ("idle", "busy")

    def set(self, state: str, proc: WorkerProcess | None = None) -> None:
        with self.lock:
            self.state = state
            if proc is not None:
                self.proc = proc


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
        self._freed_lock = threading.Lock()  # guards _freed and every _Worker.mapped
        self._load_lock = threading.Lock()  # guards every _Worker.load and the choice by it
        self._cache = BufferCache(self.config.cache_bytes, self._buffer_freed)
        self._ids = itertools.count(1)
        self._closing = False
        self._closed = threading.Event()  # set with _closing: wakes backoffs and start waits
        # Every worker is spawned from this one thread, which lives until close(): a worker
        # gets SIGKILL when the thread that spawned it exits (PR_SET_PDEATHSIG), and the threads
        # that call start() or replace a worker may exit first.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="zen-mla-spawner")
        #: input bytes copied into shared memory because they came from ordinary memory
        self.staged_bytes = 0
        self._jobs: set[PoolJob] = set()
        self._lock = threading.Lock()
        from .._status import zentorch_status

        self._warm_zentorch = bool(zentorch_status()["ops"]["zentorch_sdpa"])

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> WorkerPool:
        """Spawn every worker and wait until each has loaded torch (in parallel)."""
        try:
            for w in self._workers:
                w.set("starting", self._spawner.submit(self._new_process, w.slot).result())
            deadline = time.monotonic() + self.config.start_timeout
            for w in self._workers:
                assert w.proc is not None
                w.proc.wait_ready(deadline, self._closed)
                w.heard_at = time.monotonic()
                w.set("idle")
        except BaseException:
            for w in self._workers:
                if w.proc is not None:
                    w.proc.stop()
            self._spawner.shutdown()
            raise
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
        self._closed.set()
        deadline = time.monotonic() + grace
        for job in jobs:
            with contextlib.suppress(Exception):
                job.result(max(0.0, deadline - time.monotonic()))
        for job in jobs:
            job._fail(PoolClosedError("the worker pool shut down before this batch finished"))
        for w in self._workers:
            w.queue.put(None)
            with w.lock:
                if w.current is not None and w.proc is not None:
                    w.proc.kill()
        for w in self._workers:
            if w.thread is not None:
                w.thread.join(timeout=5)
            with w.lock:
                proc, w.proc, w.state = w.proc, None, "stopped"
            if proc is not None:
                proc.stop()
        self._spawner.shutdown(wait=False, cancel_futures=True)
        self._cache.clear()

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's id, CPUs, threads, state, liveness, pid and restarts (for /health).

        `state`: "starting" (being spawned or replaced), "idle", "busy", "stuck" (silent for
        `ping_timeout` s, say stopped; a busy one is left to finish or be abandoned), "dead"
        (exited, not noticed yet) or "stopped" (pool closed). `alive`: idle or busy.
        """
        out = []
        for w in self._workers:
            with w.lock:
                proc, state, restarts = w.proc, w.state, w.restarts
                running = proc is not None and proc.is_alive()
            if state in ("idle", "busy", "stuck") and not running:
                state = "dead"
            out.append(
                {
                    "id": w.slot.id,
                    "cpus": list(w.slot.cpus),
                    "threads": w.slot.threads,
                    "alive": state in ("idle", "busy"),
                    "state": state,
                    "pid": proc.pid if proc is not None else None,
                    "restarts": restarts,
                }
            )
        return out

    def _new_process(self, slot: WorkerSlot) -> WorkerProcess:
        return WorkerProcess(slot, self._warm_zentorch, self.config.ping_interval)

    def _replace(self, w: _Worker, why: str) -> None:
        """Kill `w`'s process and start another, retrying with backoff (0.1 s doubling to 5 s)
        until one starts or the pool closes; `w`'s queued work moves to ready workers."""
        with w.lock:
            old, w.proc, w.state = w.proc, None, "starting"
            w.restarts += 1
        log.warning("worker %d (pid %s) %s; replacing it", w.slot.id, old.pid if old else None, why)
        if old is not None:
            old.kill()
            old.stop()
        with self._freed_lock:
            w.mapped.clear()
            self._freed = {i for i in self._freed if any(i in o.mapped for o in self._workers)}
        self._redistribute(w)
        self._respawn(w)

    def _respawn(self, w: _Worker) -> None:
        """Start a process for `w`, which has none (retrying until one is ready or the pool
        closes)."""
        proc = start_until_ready(
            lambda: self._spawner.submit(self._new_process, w.slot).result(),
            self.config.start_timeout,
            self._closed,
            f"worker {w.slot.id}",
        )
        if proc is not None:
            w.heard_at = time.monotonic()
            w.set("idle", proc)
            log.warning("worker %d replaced (pid %s)", w.slot.id, proc.pid)

    def _redistribute(self, w: _Worker) -> None:
        """Move work queued on `w` (being replaced) to workers that can take it now."""
        if not any(o.ready for o in self._workers if o is not w):
            return
        moved: list[_Task] = []
        with contextlib.suppress(queue.Empty):
            for _ in range(w.queue.qsize()):
                task = w.queue.get_nowait()
                if task is None:
                    w.queue.put(None)  # close() asked this dispatcher to stop
                    break
                moved.append(task)
        for task in moved:
            with self._load_lock:
                w.load -= task.cost
            self._enqueue(task, exclude=w)

    # -- dispatch ----------------------------------------------------------------------------

    def _dispatch_loop(self, w: _Worker) -> None:
        while True:
            try:
                if not self._dispatch_one(w):
                    return
            except Exception as exc:  # a bug of ours: fail the task at hand, keep dispatching
                log.exception("worker %d: dispatcher error", w.slot.id)
                with w.lock:
                    task, w.current = w.current, None
                if task is not None:
                    task.job._fail(KernelError(f"worker {w.slot.id}: {type(exc).__name__}: {exc}"))
                if w.state == "busy":
                    w.set("idle")
                self._closed.wait(0.1)  # no hot loop should the error repeat

    def _dispatch_one(self, w: _Worker) -> bool:
        """Run one task from `w`'s queue, or check on the idle worker; False: pool closed."""
        try:
            task = w.queue.get(timeout=self.config.ping_interval)
        except queue.Empty:
            if not self._closing:
                self._check_idle(w)
            return True
        if task is None:
            return False
        with self._load_lock:
            w.load -= task.cost
        if task.job.done():
            return True  # cancelled or failed while queued
        if w.proc is None and not self._closing:
            self._respawn(w)  # a replacement an error of ours interrupted
        if w.proc is None:  # the pool closed before a replacement started
            self._lost(task, w)
            return True
        with w.lock:
            w.current = task  # left set if _run_on raises: _dispatch_loop fails it
        outcome = self._run_on(w, w.proc, task)
        with w.lock:
            w.current = None
        if isinstance(outcome, str):  # the process died under the task, or the pipe broke
            self._lost(task, w)  # first, so that the work need not wait for the respawn
            if not self._closing:
                self._replace(w, outcome)
        elif isinstance(outcome, SendFailedError):
            task.job._fail(
                ServiceUnavailableError(
                    f"could not hand work to worker {w.slot.id}: {outcome}", retry_after=1.0
                )
            )
        elif outcome[0] == "done":
            task.job._piece_done()
        else:
            task.job._fail(KernelError(f"worker {w.slot.id}: {outcome[2]}: {outcome[3]}"))
        return True

    def _check_idle(self, w: _Worker) -> None:
        """Read the heartbeats of an idle worker; replace it if it died or fell silent (it holds
        no work, so nothing is lost)."""
        proc = w.proc
        if proc is None:
            self._respawn(w)  # a replacement an error of ours interrupted
            return
        try:
            while proc.conn.poll(0):
                proc.conn.recv()
                w.heard_at = time.monotonic()
        except (EOFError, OSError):
            self._replace(w, "closed its pipe")
            return
        if not proc.is_alive():
            self._replace(w, f"exited (code {proc.process.exitcode})")
        elif time.monotonic() - w.heard_at > self.config.ping_timeout:
            self._replace(w, f"was silent for {self.config.ping_timeout} s while idle")

    def _run_on(
        self, w: _Worker, proc: WorkerProcess, task: _Task
    ) -> tuple[Any, ...] | SendFailedError | str:
        """The worker's answer to `task`, SendFailedError if it could not be sent, or why the
        process is lost."""
        if task.job.started_at is None:
            task.job.started_at = time.perf_counter()
        with self._freed_lock:
            forget = w.mapped & self._freed
            fresh = [b for b in task.buffers if b.id not in w.mapped]
        spec = {
            **task.spec,
            "buffers": [(b.id, b.nbytes, b in fresh) for b in task.buffers],
            "forget": sorted(forget),
        }
        try:
            proc.send(("run", task.id, spec), [b.fd for b in fresh])
        except SendFailedError as exc:
            log.warning("worker %d: could not send a task: %s", w.slot.id, exc)
            return exc
        except WorkerGoneError as exc:
            return f"lost its pipe ({exc})"
        with self._freed_lock:
            w.mapped -= forget
            w.mapped |= {b.id for b in fresh}
            self._freed -= {i for i in forget if not any(i in o.mapped for o in self._workers)}
        w.set("busy")
        while True:
            ready = wait([proc.conn, proc.sentinel], self.config.ping_interval)
            if proc.conn in ready:
                try:
                    msg: tuple[Any, ...] = proc.conn.recv()
                except (EOFError, OSError):
                    return "died"
                w.heard_at = time.monotonic()
                if w.state == "stuck":
                    log.warning("worker %d (pid %s) is answering again", w.slot.id, proc.pid)
                    w.set("busy")
                if msg[0] in ("done", "error") and msg[1] == task.id:
                    w.set("idle")
                    if msg[0] == "error":  # the worker unmapped the task's buffers
                        with self._freed_lock:
                            w.mapped -= {b.id for b in task.buffers}
                    return msg
            elif proc.sentinel in ready:
                return f"died (exit code {proc.process.exitcode})"
            elif w.state != "stuck" and time.monotonic() - w.heard_at > self.config.ping_timeout:
                # Not killed: a slow task is the caller's to abandon (its deadline); a stopped
                # one may resume. Reported as not alive meanwhile.
                log.warning(
                    "worker %d (pid %s) silent for %.1f s mid-task: stuck",
                    w.slot.id,
                    proc.pid,
                    time.monotonic() - w.heard_at,
                )
                w.set("stuck")

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
        self._enqueue(task, exclude=dead)

    def _enqueue(self, task: _Task, exclude: _Worker | None = None) -> None:
        """Queue `task` on the least-loaded ready worker (other than `exclude`), or, if none is
        ready, on the least-loaded one (it runs when its replacement is up)."""
        with self._load_lock:
            others = [w for w in self._workers if w is not exclude] or self._workers
            w = min([o for o in others if o.ready] or others, key=lambda o: o.load)
            w.load += task.cost
            w.queue.put(task)

    def _cancel(self, job: PoolJob) -> None:
        for w in self._workers:
            with w.lock:
                task, proc = w.current, w.proc
                if task is not None and task.job is job and proc is not None:
                    proc.kill()  # the dispatcher sees the death and replaces the worker

    # -- submission --------------------------------------------------------------------------

    def buffer(self, nbytes: int) -> SharedBuffer:
        """Shared memory for the caller to fill (say, a request body read from a socket);
        tensors viewing it are passed to `submit()` with `inputs=` and read in place.
        ServiceUnavailableError (try again) when this process is out of descriptors or memory,
        as `submit()`."""
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
            try:
                staging = src = self._cache.get(sum(sizes))
            except ServiceUnavailableError:
                self._cache.put(out_buf)
                raise
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
            self._enqueue(task)
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
