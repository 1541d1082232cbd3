"""The worker pool's face: `WorkerPool` starts and closes the workers, turns a ragged batch into
tasks and places each on the least-loaded worker.

Each worker's `Dispatcher` runs its tasks and replaces it when it dies; work lost with a dead
worker is retried once on another; a job abandoned by its caller has its busy workers killed
and replaced. Failing to send work (no memory or buffer space) fails it, never the worker."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from ..attention.batch import RaggedBatch
from ..attention.latent import LatentBatch
from ..attention.status import host_status
from ..errors import KernelError, PoolClosedError, ServiceUnavailableError
from ._config import PoolConfig
from ._direct import DirectRun
from ._dispatch import Dispatcher, WorkerState
from ._job import OutputPlaces, PoolJob, PoolResult, Reply, Task
from ._messages import Latent, TaskSpec
from ._process import WorkerProcess
from ._schedule import schedule
from ._shm import BufferCache, SharedBuffer, WorkerMappings, tensor_ref
from .topology import WorkerSlot, discover_ccxs, plan_workers

__all__ = ["WorkerPool"]


class WorkerPool:
    """Worker processes over the CCXs of the CPUs this process may use. `submit_batch()`
    splits a ragged batch into pieces by cost and returns a `PoolJob`; inputs in this pool's
    `SharedBuffer`s are read in place, others copied into shared memory once."""

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        ccxs = discover_ccxs(self.config.sysfs)
        self.slots = plan_workers(ccxs, self.config.workers, smt=self.config.smt)
        self._mappings = WorkerMappings(s.id for s in self.slots)
        self._cache = BufferCache(self.config.cache_bytes, self._mappings.freed)
        self._ids = itertools.count(1)
        # _lock guards _closing and _jobs; _closed is set right after _closing, and wakes
        # backoffs and start waits
        self._lock = threading.Lock()
        self._closing = False
        self._closed = threading.Event()
        self._jobs: set[PoolJob] = set()
        # held while choosing a dispatcher by load and queueing on it, so that two placements
        # do not both pick the same least-loaded one
        self._place_lock = threading.Lock()
        # Every worker is spawned from this one thread, which lives until close(): a worker
        # gets SIGKILL when the thread that spawned it exits (PR_SET_PDEATHSIG), and the threads
        # that call start() or replace a worker may exit first.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="zen-mla-spawner")
        self._dispatchers = [
            Dispatcher(
                s, self.config, self._spawn, self._mappings, self._closed, self._lost, self._strand
            )
            for s in self.slots
        ]
        self._warm_zentorch = host_status().sdpa_ok

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> WorkerPool:
        """Spawn every worker and wait until each has loaded torch (in parallel)."""
        try:
            for d in self._dispatchers:
                d.spawn()
            deadline = time.monotonic() + self.config.start_timeout
            for d in self._dispatchers:
                d.wait_ready(deadline)
        except BaseException:
            for d in self._dispatchers:
                d.stop()
            self._spawner.shutdown()
            raise
        for d in self._dispatchers:
            d.start()
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
        for d in self._dispatchers:
            d.stop_dispatching()
        for d in self._dispatchers:
            d.stop()
        self._spawner.shutdown(wait=False, cancel_futures=True)
        self._cache.clear()

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's id, CPUs, threads, state, liveness, pid and restarts (for /health).

        `state`: "starting" (being spawned or replaced), "idle", "busy", "stuck" (silent for
        `heartbeat_timeout` s, say stopped; a busy one is left to finish or be abandoned), "dead"
        (exited, not noticed yet) or "stopped" (pool closed). `alive`: idle or busy.
        """
        return [d.info() for d in self._dispatchers]

    def _new_process(self, slot: WorkerSlot) -> WorkerProcess:
        return WorkerProcess(slot, self._warm_zentorch, self.config.heartbeat_interval)

    def _spawn(self, slot: WorkerSlot) -> WorkerProcess:
        """A new process for `slot`, started from the spawner thread."""
        return self._spawner.submit(self._new_process, slot).result()

    # -- placing work ------------------------------------------------------------------------

    def _enqueue(self, task: Task, exclude: Dispatcher | None = None) -> None:
        """Queue `task` on the least-loaded ready worker (other than `exclude`), or, if none is
        ready, on the least-loaded one (it runs when its replacement is up)."""
        with self._place_lock:
            others = [d for d in self._dispatchers if d is not exclude] or self._dispatchers
            d = min([o for o in others if o.ready] or others, key=lambda o: o.queue.load)
            d.queue.put(task)

    def _lost(self, task: Task, dead: Dispatcher) -> None:
        """`dead`'s worker died under `task`: run it once more elsewhere, unless closing."""
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

    def _strand(self, replaced: Dispatcher) -> None:
        """Move work queued on `replaced` (being replaced) to workers that can take it now."""
        if not any(d.ready for d in self._dispatchers if d is not replaced):
            return
        for task in replaced.queue.take_all():
            self._enqueue(task, exclude=replaced)

    def _cancel(self, job: PoolJob) -> None:
        for d in self._dispatchers:
            d.cancel(job)

    # -- submission --------------------------------------------------------------------------

    def buffer(self, nbytes: int, prefault: bool = True) -> SharedBuffer:
        """Shared memory to fill (a request body, say) whose tensors `submit_batch(inputs=)` reads
        in place (`prefault=False`: its pages are left to `fault_in()` as it fills);
        ServiceUnavailableError (try again) when out of descriptors or memory."""
        return self._cache.get(nbytes, prefault)

    def adopt(self, fd: int, nbytes: int) -> SharedBuffer:
        """A buffer over a client's memfd (`fd` is the buffer's from now on, and must not shrink
        below `nbytes`), for `inputs=` and `outputs=`; workers unmap it once it is freed."""
        return SharedBuffer.adopt(fd, nbytes, self._mappings.freed)

    def release(self, buf: SharedBuffer) -> None:
        self._cache.put(buf)

    def submit_batch(
        self,
        batch: RaggedBatch | LatentBatch,
        kernel: str,
        *,
        return_lse: bool,
        inputs: SharedBuffer | Sequence[SharedBuffer] | None = None,
        outputs: OutputPlaces | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        reply: Reply | None = None,
        caller: Hashable = None,
        precision: str = "auto",
    ) -> PoolJob:
        """Queue a validated batch with a selected kernel name. q, k and v lying in `inputs`
        are read in place (else copied into shared memory once); `outputs` says where `out` and
        `lse` are to be written (else in a buffer of the pool's).

        `loop`: the running event loop, when called from its thread. A batch that is one task
        then goes straight to an idle worker from this thread, and its answer is read here
        too (`_direct`); the job completes in the loop's thread. `reply`: written by that
        worker once the work is done (`Reply`); a batch queued instead is never answered so.
        `caller`: who asks (any hashable name); queued tasks take turns between callers.

        A `LatentBatch` (keys and values as MLA's latent cache) is run in the form `kernel`
        names ("expand", "absorb" or "auto") and in `precision`, its `w_kv_b` read in place
        like its other inputs (a weight registered once lies in a buffer of its own, given in
        `inputs`)."""
        if self._closing:
            raise PoolClosedError("the worker pool is shut down")
        tq, h, _ = batch.q.shape
        inputs_of: tuple[torch.Tensor, ...]
        if isinstance(batch, LatentBatch):
            inputs_of = (batch.q, batch.kv_c, batch.k_pe, batch.w_kv_b)
        else:
            inputs_of = (batch.q, batch.k, batch.v)
        if outputs is None:
            outputs = self._cache.outputs(tq, h, batch.v_head_dim, batch.q.dtype, return_lse)
            cache: BufferCache | None = self._cache  # the outputs' buffer goes back to it
        else:
            cache = None  # a caller's buffer stays theirs
        out_buf, out, lse = outputs
        given = [inputs] if isinstance(inputs, SharedBuffer) else list(inputs or ())
        try:
            homes, tensors, staging = self._cache.place(inputs_of, given)
        except ServiceUnavailableError:
            if cache is not None:
                cache.put(out_buf)
            raise

        refs = [tensor_ref(home, t) for home, t in zip(homes, tensors, strict=True)]
        latent = None
        if isinstance(batch, LatentBatch):
            latent = Latent(refs[1], refs[2], refs[3], kernel, precision)
        k, v = (None, None) if latent is not None else (refs[1], refs[2])
        job = PoolJob(kernel=kernel)
        buffers = list({id(b): b for b in (*homes, out_buf)}.values())
        common = TaskSpec(
            kernel=kernel,
            causal=batch.causal,
            scale=batch.scale,
            q=refs[0],
            k=k,
            v=v,
            out=tensor_ref(out_buf, out),
            lse=tensor_ref(out_buf, lse) if lse is not None else None,
            latent=latent,
        )
        plan = schedule(
            batch.q_cu_seq_lens,
            batch.kv_cu_seq_lens,
            h,
            batch.causal,
            len(self._dispatchers),
            self.config.min_piece_cost,
        )
        tasks = []
        for pieces in plan:
            if not pieces:
                continue
            cost = sum(p.cost for p in pieces)
            threads = 1 if cost < self.config.min_thread_cost else 0  # 0: all the worker's
            spec = replace(common, pieces=tuple(pieces), threads=threads)
            tasks.append(Task(next(self._ids), job, spec, buffers, cost, caller=caller))

        def finish(j: PoolJob) -> None:
            if staging is not None:
                self._cache.put(staging)
            j._succeed(PoolResult(out, lse, kernel, out_buf, cache, j.replied))

        job._pending = len(tasks)
        job._finish = finish
        if not tasks:
            finish(job)
            return job
        with self._lock:
            if self._closing:
                raise PoolClosedError("the worker pool is shut down")
            self._jobs.add(job)
        job.future.add_done_callback(lambda future: self._settled(job, future.cancelled()))
        if loop is not None and len(tasks) == 1 and self._run_direct(tasks[0], loop, reply):
            return job
        # the plan's i-th share goes to the least-loaded worker, biggest share first
        for task in sorted(tasks, key=lambda t: -t.cost):
            self._enqueue(task)
        return job

    def _run_direct(self, task: Task, loop: asyncio.AbstractEventLoop, reply: Reply | None) -> bool:
        """Run `task` on the least-loaded worker from `loop`'s thread if that worker is idle
        with nothing queued (`_direct`); False: queue it as usual."""
        with self._place_lock:
            d = min(self._dispatchers, key=lambda o: (o.state != WorkerState.IDLE, o.queue.load))
            proc = d.lend(task)
        return proc is not None and DirectRun(d, proc, task, loop, reply).start()

    def _settled(self, job: PoolJob, cancelled: bool) -> None:
        if cancelled:  # abandoned: stop the workers busy with it, their CCXs are free at once
            self._cancel(job)
        with self._lock:
            self._jobs.discard(job)
        # drop the closures holding the job's shared buffers: freed now, not at the next gc
        job._finish = None
