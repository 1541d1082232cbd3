"""The FastAPI app: POST /prefill, GET /health, /health/live, /metrics.

The app owns the worker pool through its lifespan. A request body is read straight into the
pool's shared memory (`ingest`), decoded as views, run by the workers and sent back from the
shared memory the workers wrote; errors leave as problem+json through `problems.problem`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from zen_mla import wire
from zen_mla._errors import (
    BodyTooLargeError,
    DeadlineExceededError,
    KernelError,
    LengthRequiredError,
    ServiceUnavailableError,
    UnauthorizedError,
    UnsupportedMediaTypeError,
    WorkTooLargeError,
    ZenMLAError,
    status_of,
)
from zen_mla._status import zentorch_status
from zen_mla.kernels import select_kernel
from zen_mla.pool import PoolConfig, PoolResult, SharedBuffer, WorkerPool

from .ingest import SMALL_BYTES, Admission, Ticket, give_back, read_body
from .metrics import Metrics
from .problems import PROBLEM_RESPONSES, Problem, problem
from .settings import Settings

log = logging.getLogger("zen_mla.service")
SEND_CHUNK = 4 << 20  # bytes per write: lets the transport's flow control work


@dataclass
class ServiceState:
    settings: Settings
    pool: WorkerPool | None = None
    ready: bool = False
    draining: bool = False
    start_error: str | None = None
    # zentorch_status(), once its probe (seconds, in a thread at start) is done; /health reads
    # this instead of calling it, which would block the event loop on the probe meanwhile
    zentorch: dict[str, Any] | None = None
    metrics: Metrics = field(default_factory=Metrics)
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.settings)

    @property
    def inflight(self) -> int:
        """Requests admitted and not answered: bodies being read, queued or computing."""
        return self.admission.inflight


def create_app(settings: Settings | None = None, pool: WorkerPool | None = None) -> FastAPI:
    """The app for `settings` (default: from the environment).

    Without `pool`, the app owns one: it starts in the background with the app's lifespan
    (/health answers 503 "starting" until every worker is up) and closes with it. A started
    `pool` passed in stays the caller's to close (tests and embedding use this).
    """
    settings = settings or Settings()
    state = ServiceState(settings, pool=pool, ready=pool is not None)
    if pool is not None:
        state.zentorch = zentorch_status()  # probed already when the pool was made

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if pool is not None:
            yield
            return

        async def start() -> None:
            try:
                state.zentorch = await asyncio.to_thread(zentorch_status)  # off the event loop
                pool = WorkerPool(PoolConfig(workers=settings.worker_count, smt=settings.smt))
                state.pool = pool
                await asyncio.to_thread(pool.start)
                state.ready = True
            except Exception as exc:  # reported by /health; the process stays up to say so
                state.start_error = f"{type(exc).__name__}: {exc}"
                log.exception("worker pool failed to start")

        starting = asyncio.create_task(start())
        try:
            yield
        finally:
            state.draining, state.ready = True, False
            await starting
            if state.pool is not None:
                await asyncio.to_thread(state.pool.close, settings.drain_timeout_s)

    app = FastAPI(title="zen-mla", version="0.1.0", lifespan=lifespan)
    app.state.service = state

    @app.exception_handler(ZenMLAError)
    async def _zen_error(request: Request, exc: ZenMLAError) -> Response:
        return problem(exc)

    @app.get("/health/live", include_in_schema=True)
    async def live() -> dict[str, str]:
        """200 while the process runs."""
        return {"status": "alive"}

    # HEAD answers as GET does, headers included; uvicorn sends no body for HEAD.
    app.add_api_route("/health/live", live, methods=["HEAD"], include_in_schema=False)

    @app.get("/health", responses={503: {"description": "not ready, draining, or no worker alive"}})
    async def health() -> JSONResponse:
        """Readiness: zentorch, the kernel "auto" resolves to, each worker."""
        return _health(state)

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text format, names prefixed zen_mla_."""
        workers = state.pool.workers() if state.pool is not None else []
        text = state.metrics.render(
            state.admission.queued,
            state.admission.uploads,
            sum(w["alive"] for w in workers),
            sum(w["restarts"] for w in workers),
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post(
        "/prefill",
        response_class=Response,
        responses={
            200: {
                "description": "safetensors: out [Tq, H, Dv] (and lse [H, Tq] fp32)",
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            },
            **PROBLEM_RESPONSES,
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": "safetensors: q, k, v, q_cu_seq_lens[, kv_cu_seq_lens] and "
                "__metadata__ causal, return_lse, scale, kernel, request_id",
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def prefill(request: Request) -> Response:
        """Ragged MLA prefill attention (see CONTRACT.md)."""
        return await _prefill(state, request)

    # the Problem schema, referenced from every error response above
    original_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {})["Problem"] = (
                Problem.model_json_schema()
            )
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _health(state: ServiceState) -> JSONResponse:
    """200 ("ok", or "degraded" while some worker is down) only when a worker can take work."""
    status = state.zentorch or {}
    workers = state.pool.workers() if state.pool is not None else []
    alive = sum(bool(w["alive"]) for w in workers)
    if state.draining:
        word = "draining"
    elif state.start_error:
        word = "failed"
    elif not state.ready:
        word = "starting"
    elif alive == 0:
        word = "no_worker"
    elif alive < len(workers):
        word = "degraded"
    else:
        word = "ok"
    a = state.admission
    body = {
        "status": word,
        "zentorch": {k: status.get(k) for k in ("installed", "version", "ops")},
        "kernel": status.get("auto_kernel"),
        "kernel_reason": status.get("reason"),
        "cpu": status.get("cpu"),
        "workers": workers,
        "inflight": a.inflight,
        "uploads": a.uploads,
        "queued": a.queued,
        "inflight_bytes": a.inflight_bytes,
        "error": state.start_error,
    }
    return JSONResponse(body, status_code=200 if word in ("ok", "degraded") else 503)


def _admit(state: ServiceState, request: Request) -> Ticket:
    """Checks made before a byte of the body is read; the request's share of the admission."""
    s = state.settings
    if state.draining:
        raise ServiceUnavailableError("the service is draining for shutdown", retry_after=5)
    if not state.ready or state.pool is None:
        raise ServiceUnavailableError(
            state.start_error or "the worker pool is starting", retry_after=5
        )
    if s.api_token is not None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        good = s.api_token.get_secret_value().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), good):
            raise UnauthorizedError("a valid bearer token is required (Authorization: Bearer ...)")
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/octet-stream":
        raise UnsupportedMediaTypeError(
            f"Content-Type: expected application/octet-stream, got {media or 'none'}"
        )
    length = request.headers.get("content-length")
    if length is None or not length.isdigit():
        raise LengthRequiredError("Content-Length: expected the body size in bytes, got none")
    n = int(length)
    if n > s.max_body_bytes:
        raise BodyTooLargeError(
            f"Content-Length: expected at most {s.max_body_bytes} bytes, got {n}"
        )
    state.admission.check_queue()  # a full queue now is a 429 now, not after the upload
    return state.admission.admit(n)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _prefill(state: ServiceState, request: Request) -> Response:
    t0 = time.perf_counter()
    s = state.settings
    request_id: str | None = None
    status, bytes_in, bytes_out = 500, 0, 0
    buf: SharedBuffer | None = None
    ticket: Ticket | None = None
    info: dict[str, Any] = {}
    try:
        ticket = _admit(state, request)
        pool = state.pool
        assert pool is not None
        n = int(request.headers["content-length"])
        loop = asyncio.get_running_loop()
        buf = await read_body(
            request.receive,
            n,
            pool,
            min_rate=s.min_body_rate,
            grace_s=s.body_grace_s,
            deadline_at=loop.time() - (time.perf_counter() - t0) + s.deadline_s,
            deadline_s=s.deadline_s,
        )
        bytes_in = n
        ingest_s = time.perf_counter() - t0
        ticket.uploaded()
        tensors, meta = wire.decode(buf.tensor(0, (n,), torch.uint8), wire.REQUEST_TENSORS)
        request_id = meta.get("request_id")
        options = wire.parse_options(meta)
        batch = wire.request_batch(tensors, options)
        work = batch.work()
        if work > s.max_work:
            raise WorkTooLargeError(
                "work",
                f"H * Dqk * visible query-key pairs <= {s.max_work} (the service's cap)",
                str(work),
                "Split the batch into smaller requests",
            )
        kernel = select_kernel(options.kernel, batch.q.dtype, return_lse=options.return_lse)
        info = {"tq": batch.q.shape[0], "tk": batch.k.shape[0], "b": batch.num_requests}
        ticket.enqueue()
        submit = functools.partial(
            pool.submit_batch, batch, kernel.name, return_lse=options.return_lse, inputs=buf
        )
        tq, h, _ = batch.q.shape
        if tq * h * batch.v_head_dim * batch.v.element_size() > SMALL_BYTES:
            job = await asyncio.to_thread(submit)  # the pool makes (pre-faults) `out` at once
        else:
            job = submit()
        waiting = asyncio.wrap_future(job._future)
        gone: asyncio.Future[None] = asyncio.create_task(_disconnected(request))
        remaining = s.deadline_s - (time.perf_counter() - t0)
        watch: set[asyncio.Future[Any]] = {waiting, gone}
        done, _ = await asyncio.wait(
            watch, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED
        )
        gone.cancel()
        if waiting not in done:
            job.cancel()
            if gone in done:
                status = 499  # client closed the connection (nginx's convention), for metrics
                return Response(status_code=499)
            raise DeadlineExceededError(
                f"the request ran past its {s.deadline_s} s deadline; its work was abandoned"
            )
        result = waiting.result()
        held, buf = buf, None
        await give_back(pool, held)
        done_at = time.perf_counter()
        queue_s = (job.started_at or done_at) - job.queued_at
        compute_s = done_at - (job.started_at or done_at)
        state.metrics.observe("queue", queue_s)
        state.metrics.observe("compute", compute_s)
        state.metrics.count_tokens(batch.q.shape[0], batch.k.shape[0])
        response = _send(result, kernel.name, request_id)
        response.headers["Server-Timing"] = (
            f"ingest;dur={ingest_s * 1e3:.3f}, queue;dur={queue_s * 1e3:.3f}, "
            f"compute;dur={compute_s * 1e3:.3f}"
        )
        status, bytes_out = 200, int(response.headers["content-length"])
        info |= {
            "ingest_ms": round(ingest_s * 1e3, 3),
            "queue_ms": round(queue_s * 1e3, 3),
            "compute_ms": round(compute_s * 1e3, 3),
        }
        return response
    except ClientDisconnect:
        status = 499
        return Response(status_code=499)
    except ZenMLAError as exc:
        status = status_of(exc)
        # Answered before the whole body came: the connection closes (lingering, see
        # protocol.py) rather than reading an unbounded rest of the body to keep it alive.
        return problem(exc, request_id, None if bytes_in else {"Connection": "close"})
    except Exception as exc:  # a bug of ours: a 500 problem, never a dropped connection
        log.exception("prefill failed")
        status = 500
        return problem(KernelError(f"internal error: {type(exc).__name__}: {exc}"), request_id)
    finally:
        if buf is not None and state.pool is not None:
            await give_back(state.pool, buf)
        if ticket is not None:
            ticket.close()
        total = time.perf_counter() - t0
        state.metrics.observe("total", total)
        state.metrics.count_request(status, bytes_in, bytes_out)
        log.info(
            json.dumps(
                {
                    "event": "prefill",
                    "request_id": request_id,
                    "status": status,
                    "bytes_in": bytes_in,
                    "bytes_out": bytes_out,
                    "total_ms": round(total * 1e3, 3),
                    **info,
                }
            )
        )


def _send(result: PoolResult, kernel: str, request_id: str | None) -> StreamingResponse:
    """safetensors header, then out and lse straight from the shared memory the workers wrote.

    The memory goes back to the pool only when nothing refers to it any more: the transport
    (uvloop) may keep a chunk it could not write at once and send it after the app is done, so
    release waits for the arrays behind the chunks to be collected, not for the last yield.
    """
    outputs = {"out": result.out} | ({"lse": result.lse} if result.lse is not None else {})
    meta = {"kernel": kernel} | ({"request_id": request_id} if request_id else {})
    header, chunks = wire.encode(outputs, meta)
    length = len(header) + sum(c.nbytes for c in chunks)
    _release_when_collected(result, [c.obj for c in chunks if c.nbytes])

    async def body() -> AsyncIterator[bytes | memoryview]:
        yield header
        while chunks:
            chunk = chunks.pop(0)
            for i in range(0, chunk.nbytes, SEND_CHUNK):
                yield chunk[i : i + SEND_CHUNK]
            del chunk

    return StreamingResponse(
        body(),
        media_type="application/octet-stream",
        headers={"Content-Length": str(length)},
    )


def _release_when_collected(result: PoolResult, exporters: list[object]) -> None:
    if not exporters:
        result.release()
        return
    left = [len(exporters)]
    lock = threading.Lock()

    def one_gone() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            result.release()

    for obj in exporters:
        weakref.finalize(obj, one_gone)
