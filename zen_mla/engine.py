"""`PrefillEngine`: the one face of zen_mla that a server calls.

It takes a request's tensors and options, validates them once, applies the work cap, picks the
kernels, and runs the batch on the worker pool; the result comes back blocking or awaitable,
and every failure is a `zen_mla` exception. Every request form of the HTTP service (a
safetensors body, a regions JSON over HTTP or the region socket, a v2 infer) comes through
`prepare` and `run`. What a server needs of the pool besides (its shared buffers, the output
places a job writes to, a worker's own reply) is named here too: `SharedBuffer`,
`OutputPlaces`, `Reply`.

    with PrefillEngine(EngineConfig(max_work=1 << 40)) as engine:
        request = engine.prepare(
            {"q": q, "k": k, "v": v, "q_cu_seq_lens": cu}, PrefillOptions(return_lse=True)
        )
        job = engine.run(request)
        result = job.result()            # or: await job.wait(timeout=60)
        out, lse = result.out, result.lse
        result.release()
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .attention import latent
from .attention.batch import RaggedBatch, check_num_seqs, validate
from .attention.driver import workspace_bytes
from .attention.latent import FORMS, PRECISIONS, LatentBatch
from .attention.select import KernelChoice, select_kernel
from .attention.status import host_status
from .caller import Caller
from .errors import DeadlineExceededError, InvalidInputError, WorkTooLargeError
from .pool import OutputPlaces, PoolConfig, PoolJob, PoolResult, Reply, SharedBuffer, WorkerPool
from .wire import PrefillOptions

__all__ = [
    "LATENT_TENSORS",
    "Cost",
    "EngineConfig",
    "OutputPlaces",
    "PoolConfig",
    "PrefillEngine",
    "PrefillJob",
    "PrefillRequest",
    "PrefillResult",
    "Reply",
    "SharedBuffer",
]

#: the tensors of a prefill request, by the contract's names
REQUIRED_TENSORS = ("q", "k", "v", "q_cu_seq_lens")
#: those of a request whose keys and values are MLA's latent cache (`latent_attention`)
LATENT_TENSORS = ("q", "kv_c", "k_pe", "w_kv_b", "q_cu_seq_lens")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """pool: the worker processes; max_work: cap on a request's `work` (H * Dqk * visible
    query-key pairs), None for none; max_seqs: cap on its sequences (B), None for none."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    max_work: int | None = None
    max_seqs: int | None = None


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """out `[Tq, H, Dv]` (v's dtype) and lse `[H, Tq]` fp32 or None, views of shared memory
    the workers wrote; `kernels` says what computed them. `release()` hands the memory back
    for reuse (the tensors must not be used after it); without it, the memory is freed once
    the tensors are. `replied`: the worker wrote the `Reply` the job was run with."""

    out: torch.Tensor
    lse: torch.Tensor | None
    kernels: KernelChoice
    _pool_result: PoolResult

    @property
    def replied(self) -> bool:
        return self._pool_result.replied

    def release(self) -> None:
        self._pool_result.release()


@dataclass(frozen=True, slots=True)
class Cost:
    """What a prepared request will cost, as the chosen kernel spends it, whatever the request's
    bytes: `work`, multiply-adds of the score matmul, padding included (what the work cap
    counts); `workspace_bytes`, an upper bound of the memory the kernel allocates beyond the
    inputs and results (padding, packing, tiles); `result_bytes`, out and lse."""

    work: int
    workspace_bytes: int
    result_bytes: int


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """A validated batch within the work cap, the kernels chosen for it and what it will cost
    (`prepare()`). A batch over the latent cache is computed by `latent_attention` in `form`
    (its kernels named "latent")."""

    batch: RaggedBatch | LatentBatch
    kernels: KernelChoice
    cost: Cost
    form: str | None = None
    precision: str = "auto"  # over the latent cache: `latent_attention`'s

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs

    @property
    def num_q_tokens(self) -> int:
        return int(self.batch.q.shape[0])

    @property
    def num_kv_tokens(self) -> int:
        keys = self.batch.kv_c if isinstance(self.batch, LatentBatch) else self.batch.k
        return int(keys.shape[0])


class PrefillJob:
    """A queued request (`request` says what it is). `result()` blocks, `await wait()` does
    not; `cancel()` abandons the work (its busy workers are stopped and replaced, so their CCXs
    are free again at once); `withdraw()` drops it only if no worker was given any of it."""

    def __init__(self, request: PrefillRequest, pool_job: PoolJob) -> None:
        self.request = request
        self.kernels = request.kernels
        self._job = pool_job

    @property
    def queued_at(self) -> float:
        """`time.perf_counter()` when the job was submitted."""
        return self._job.queued_at

    @property
    def started_at(self) -> float | None:
        """`time.perf_counter()` when a worker was given its first piece, None before."""
        return self._job.started_at

    @property
    def replying(self) -> bool:
        """Its worker holds the `Reply` it was run with: the caller may have its answer before
        the job is done here."""
        return self._job.replying

    def done(self) -> bool:
        return self._job.done()

    def cancel(self) -> None:
        self._job.cancel()

    def withdraw(self) -> bool:
        """Drop the job if no worker has been given any of it yet, in one step with the workers'
        taking it: True, and it is cancelled with no worker stopped. False: it has started, and
        runs on untouched (to its end or its deadline)."""
        return self._job.withdraw()

    def result(self, timeout: float | None = None) -> PrefillResult:
        """Wait for the result; past `timeout` the work is abandoned and
        DeadlineExceededError raised."""
        try:
            return self._wrap(self._job.result(timeout))
        except TimeoutError:
            self._job.cancel()
            raise DeadlineExceededError(
                f"the request ran past its {timeout} s deadline; its work was abandoned"
            ) from None

    async def wait(self, timeout: float | None = None) -> PrefillResult:
        """`result()` for asyncio: the event loop is never blocked. Cancelling the awaiting
        task abandons the work too."""
        return await self.settled(timeout)

    def settled(self, timeout: float | None = None) -> asyncio.Future[PrefillResult]:
        """The result as a future of the running loop, with no task behind it (what `wait()`
        awaits): past `timeout` it fails with DeadlineExceededError and the work is
        abandoned; cancelling it abandons the work too. A job run from the loop's thread
        settles it in the turn of the loop that reads the worker's answer."""
        loop = asyncio.get_running_loop()
        settled = self._job.settled_in(loop, self._wrap)
        if timeout is not None:
            timer = loop.call_later(max(timeout, 0.0), self._expire, settled, timeout)
            settled.add_done_callback(lambda _: timer.cancel())
        return settled

    def _expire(self, settled: asyncio.Future[PrefillResult], timeout: float) -> None:
        if settled.done():
            return
        settled.set_exception(
            DeadlineExceededError(
                f"the request ran past its {timeout} s deadline; its work was abandoned"
            )
        )
        self._job.cancel()

    def _wrap(self, result: PoolResult) -> PrefillResult:
        return PrefillResult(result.out, result.lse, self.kernels, result)


class PrefillEngine:
    """Validation, the work cap, the kernel choice and the worker pool, behind one object.

    Inputs already in one of the engine's shared buffers (`buffer()`, say a request body read
    from a socket) are read in place by the workers; others are copied into shared memory once.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        host_status()  # probe the kernels once, before the workers start
        self._pool = WorkerPool(self.config.pool)
        # a kernel's per-thread memory is counted for the widest worker
        self._threads = max(s.threads for s in self._pool.slots)

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> PrefillEngine:
        """Spawn the workers and wait until each is ready."""
        self._pool.start()
        return self

    def close(self, grace: float = 10.0) -> None:
        """Refuse new work, let running jobs finish within `grace` seconds, stop the workers."""
        self._pool.close(grace)

    def __enter__(self) -> PrefillEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's `id`, `cpus`, `threads`, `state`, `alive`, `pid` and `restarts`
        (`WorkerPool.workers` says what each means)."""
        return self._pool.workers()

    def ready(self) -> bool:
        """At least one worker can take work."""
        return any(w["alive"] for w in self._pool.workers())

    # -- requests ----------------------------------------------------------------------------

    def buffer(self, nbytes: int, prefault: bool = True) -> SharedBuffer:
        """Shared memory to fill (a request body, say); tensors viewing it that are passed to
        `run(..., inputs=buf)` are read in place by the workers. `prefault=False` leaves its
        pages to `buf.fault_in()` as it fills, so that it holds only the memory written."""
        return self._pool.buffer(nbytes, prefault)

    def release(self, buf: SharedBuffer) -> None:
        """Hand a buffer from `buffer()` back for reuse."""
        self._pool.release(buf)

    def adopt(self, fd: int, nbytes: int) -> SharedBuffer:
        """A buffer over a client's memfd (`fd` is the buffer's from now on; the caller has
        checked that it cannot shrink below `nbytes`), for `run(inputs=, outputs=)`."""
        return self._pool.adopt(fd, nbytes)

    def prepare(
        self, tensors: Mapping[str, torch.Tensor], options: PrefillOptions | None = None
    ) -> PrefillRequest:
        """The one front door of every request form: tensors by the contract's names (q, k,
        v, q_cu_seq_lens and optional kv_cu_seq_lens) and the options, validated once, within
        the sequence and work caps, with the kernels chosen and its `Cost`; not queued yet.
        Errors as `zen_mla.ragged_attention`'s (a missing tensor is named), plus
        WorkTooLargeError over the work cap (the work as the chosen kernel computes it)."""
        options = options or PrefillOptions()
        if "kv_c" in tensors:
            return self._prepare_latent(tensors, options)
        for name in REQUIRED_TENSORS:
            if name not in tensors:
                raise InvalidInputError(name, "a tensor of that name in the request", "none")
        batch = validate(
            tensors["q"],
            tensors["k"],
            tensors["v"],
            tensors["q_cu_seq_lens"],
            tensors.get("kv_cu_seq_lens"),
            causal=options.causal,
            scale=options.scale,
            max_seqs=self.config.max_seqs,
        )
        return_lse = options.return_lse
        chosen = select_kernel(options.kernel, batch.q.dtype, return_lse=return_lse)
        cost = self._cost(
            batch,
            chosen.work(batch),
            f"H * Dqk * visible query-key pairs (kernel {chosen.name!r} counts its padding)",
            workspace_bytes(batch, chosen, return_lse=return_lse, threads=self._threads),
            return_lse,
        )
        return PrefillRequest(batch, KernelChoice.of(chosen, return_lse=return_lse), cost)

    def _cost(
        self,
        batch: RaggedBatch | LatentBatch,
        work: int,
        counted: str,
        workspace: int,
        return_lse: bool,
    ) -> Cost:
        """The batch's `Cost`, its `work` (what `counted` says) within the work cap, or
        WorkTooLargeError."""
        if self.config.max_work is not None and work > self.config.max_work:
            raise WorkTooLargeError(
                "work",
                f"{counted} <= {self.config.max_work} (the service's cap)",
                str(work),
                "Split the batch into smaller requests",
            )
        tq, h, _ = batch.q.shape
        result = tq * h * batch.v_head_dim * batch.q.element_size()
        return Cost(work, workspace, result + (h * tq * 4 if return_lse else 0))

    def _prepare_latent(
        self, tensors: Mapping[str, torch.Tensor], options: PrefillOptions
    ) -> PrefillRequest:
        """`prepare` for a batch over the latent cache: q, kv_c, k_pe, w_kv_b, q_cu_seq_lens
        and optional kv_cu_seq_lens; `options.form` says how it is attended."""
        for name in ("k", "v"):
            if name in tensors:
                raise InvalidInputError(
                    name, "no k or v beside kv_c (a request over the latent cache)", "one"
                )
        for name in LATENT_TENSORS:
            if name not in tensors:
                raise InvalidInputError(name, "a tensor of that name in the request", "none")
        form = next((f for f in FORMS if f == options.form), None)
        if form is None:
            raise InvalidInputError("form", '"expand", "absorb" or "auto"', repr(options.form))
        precision = next((p for p in PRECISIONS if p == options.precision), None)
        if precision is None:
            raise InvalidInputError(
                "precision", '"auto", "bf16" or "fp32"', repr(options.precision)
            )
        batch = latent.validate_latent(
            tensors["q"],
            tensors["kv_c"],
            tensors["k_pe"],
            tensors["w_kv_b"],
            tensors["q_cu_seq_lens"],
            tensors.get("kv_cu_seq_lens"),
            causal=options.causal,
            scale=options.scale,
        )
        check_num_seqs("q_cu_seq_lens", batch.num_seqs + 1, self.config.max_seqs)
        cost = self._cost(
            batch,
            latent.work(batch, form, precision=precision, return_lse=options.return_lse),
            "multiply-adds of the latent attention's products",
            latent.workspace_bytes(batch, threads=self._threads),
            options.return_lse,
        )
        kernels = KernelChoice("latent", "latent" if options.return_lse else None)
        return PrefillRequest(batch, kernels, cost, form, precision)

    def check_num_seqs(self, name: str, entries: int) -> None:
        """A cu_seq_lens of `entries` offsets is within the sequence cap (InvalidInputError
        naming it otherwise), for a caller that must check before reading it."""
        check_num_seqs(name, entries, self.config.max_seqs)

    def run(
        self,
        request: PrefillRequest,
        *,
        inputs: SharedBuffer | Sequence[SharedBuffer] | None = None,
        outputs: OutputPlaces | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        reply: Reply | None = None,
        caller: Caller | None = None,
    ) -> PrefillJob:
        """Queue a prepared request on the workers. q, k and v lying in `inputs` (buffers of
        this engine: `buffer()`, `adopt()`) are read in place; `outputs` (a buffer, and `out`
        and `lse` views of it) says where results are written, else a buffer of the engine's.
        `loop`: the running event loop, when called from its thread: a request small enough
        for one worker then goes to an idle one from this thread and its answer is read here,
        with no thread between (see `zen_mla.pool`); `reply`, a frame that worker then writes
        to the caller's socket itself once done (`PrefillResult.replied`). `caller`: who asks:
        queued work is taken round-robin between callers. PoolClosedError
        once closed; ServiceUnavailableError (try again) when shared memory cannot be had."""
        kernels = request.kernels
        job = self._pool.submit_batch(
            request.batch,
            request.form or kernels.out,
            return_lse=kernels.lse is not None,
            precision=request.precision,
            inputs=inputs,
            outputs=outputs,
            loop=loop,
            reply=reply,
            caller=caller,
        )
        return PrefillJob(request, job)
