"""The FastAPI app: POST /prefill, GET /health, /health/live, /metrics.

The app owns the worker pool through its lifespan. A request body is read straight into the
pool's shared memory, decoded as views, run by the workers and sent back from the shared memory
the workers wrote; errors leave as problem+json through `problems.problem`.
"""

from __future__ import annotations

import asyncio
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
    QueueFullError,
    ServiceUnavailableError,
    UnauthorizedError,
    UnsupportedMediaTypeError,
    WireFormatError,
    WorkTooLargeError,
    ZenMLAError,
    status_of,
)
from zen_mla._status import zentorch_status
from zen_mla.kernels import select_kernel
from zen_mla.pool import PoolConfig, PoolResult, SharedBuffer, WorkerPool

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
    inflight: int = 0
    metrics: Metrics = field(default_factory=Metrics)


def create_app(settings: Settings | None = None, pool: WorkerPool | None = None) -> FastAPI:
    """The app for `settings` (default: from the environment).

    Without `pool`, the app owns one: it starts in the background with the app's lifespan
    (/health answers 503 "starting" until every worker is up) and closes with it. A started
    `pool` passed in stays the caller's to close (tests and embedding use this).
    """
    settings = settings or Settings()
    state = ServiceState(settings, pool=pool, ready=pool is not None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if pool is not None:
            yield
            return

        async def start() -> None:
            try:
                await asyncio.to_thread(zentorch_status)  # probe once, off the event loop
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

    @app.get("/health", responses={503: {"description": "not ready, or draining"}})
    async def health() -> JSONResponse:
        """Readiness: zentorch, the kernel "auto" resolves to, each worker."""
        status = zentorch_status()
        workers = state.pool.workers() if state.pool is not None else []
        if state.draining:
            word = "draining"
        elif state.start_error:
            word = "failed"
        elif not state.ready:
            word = "starting"
        elif not all(w["alive"] for w in workers):
            word = "degraded"
        else:
            word = "ok"
        body = {
            "status": word,
            "zentorch": {k: status[k] for k in ("installed", "version", "ops")},
            "kernel": status["auto_kernel"],
            "kernel_reason": status["reason"],
            "cpu": status["cpu"],
            "workers": workers,
            "inflight": state.inflight,
            "error": state.start_error,
        }
        return JSONResponse(body, status_code=200 if word in ("ok", "degraded") else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text format, names prefixed zen_mla_."""
        workers = state.pool.workers() if state.pool is not None else []
        text = state.metrics.render(
            state.inflight,
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


def _admit(state: ServiceState, request: Request) -> int:
    """Checks made before a byte of the body is read; returns the Content-Length."""
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
    if state.inflight >= s.max_queue:
        raise QueueFullError(f"{state.inflight} requests are queued or running", retry_after=1)
    return n


async def _read_body(request: Request, buf: SharedBuffer, n: int) -> None:
    """The body, straight into shared memory: one copy from each chunk uvicorn hands us."""
    view, pos = buf.bytes_view, 0
    async for chunk in request.stream():
        end = pos + len(chunk)
        if end > n:
            raise WireFormatError("body", f"{n} bytes (its Content-Length)", "more")
        view[pos:end] = chunk
        pos = end
    if pos != n:
        raise WireFormatError("body", f"{n} bytes (its Content-Length)", f"{pos} bytes")


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
    admitted = False
    info: dict[str, Any] = {}
    try:
        n = _admit(state, request)
        pool = state.pool
        assert pool is not None
        state.inflight += 1
        admitted = True
        buf = pool.buffer(n)
        try:
            async with asyncio.timeout(s.deadline_s):
                await _read_body(request, buf, n)
        except TimeoutError:
            raise DeadlineExceededError(
                f"the body did not arrive within {s.deadline_s} s"
            ) from None
        bytes_in = n
        ingest_s = time.perf_counter() - t0
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
        job = pool.submit_batch(batch, kernel.name, return_lse=options.return_lse, inputs=buf)
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
        pool.release(buf)
        buf = None
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
        return problem(exc, request_id)
    except Exception as exc:  # a bug of ours: a 500 problem, never a dropped connection
        log.exception("prefill failed")
        status = 500
        return problem(KernelError(f"internal error: {type(exc).__name__}: {exc}"), request_id)
    finally:
        if admitted:
            state.inflight -= 1
        if buf is not None and state.pool is not None:
            state.pool.release(buf)
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
