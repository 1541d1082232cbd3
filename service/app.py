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
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from zen_mla import (
    BodyTooLargeError,
    KernelError,
    LengthRequiredError,
    ServiceUnavailableError,
    UnauthorizedError,
    UnsupportedMediaTypeError,
    ZenMLAError,
    region_request,
    status_of,
    wire,
    zentorch_status,
)
from zen_mla.engine import EngineConfig, PrefillEngine, PrefillJob, PrefillRequest, PrefillResult
from zen_mla.pool import PoolConfig, SharedBuffer
from zen_mla.region_server import RegionServer
from zen_mla.regions import RegionRegistry

from .ingest import SMALL_BYTES, Admission, Ticket, give_back, read_body
from .metrics import Metrics
from .problems import PROBLEM_RESPONSES, Problem, problem
from .regions import answer as region_answer
from .regions import resolve as resolve_regions
from .settings import Settings

log = logging.getLogger("zen_mla.service")
SEND_CHUNK = 4 << 20  # bytes per write: lets the transport's flow control work


@dataclass
class ServiceState:
    settings: Settings
    engine: PrefillEngine | None = None
    ready: bool = False
    draining: bool = False
    start_error: str | None = None
    # zentorch_status(), once its probe (seconds, in a thread at start) is done; /health reads
    # this instead of calling it, which would block the event loop on the probe meanwhile
    zentorch: dict[str, Any] | None = None
    # same-host regions (None while shared memory is off or not started); owned by the event
    # loop's thread, as the region server that fills it runs there
    regions: RegionRegistry | None = None
    region_server: RegionServer | None = None
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    metrics: Metrics = field(default_factory=Metrics)
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.settings)

    @property
    def inflight(self) -> int:
        """Requests admitted and not answered: bodies being read, queued or computing."""
        return self.admission.inflight


def create_app(settings: Settings | None = None, engine: PrefillEngine | None = None) -> FastAPI:
    """The app for `settings` (default: from the environment).

    Without `engine`, the app owns one: it starts in the background with the app's lifespan
    (/health answers 503 "starting" until every worker is up) and closes with it. A started
    `engine` passed in stays the caller's to close (tests and embedding use this).
    """
    settings = settings or Settings()
    state = ServiceState(settings, engine=engine, ready=engine is not None)
    if engine is not None:
        state.zentorch = zentorch_status()  # probed already when the engine was made

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            _serve_regions(state, engine)
            try:
                yield
            finally:
                if state.region_server is not None:
                    state.region_server.close()
            return

        async def start() -> None:
            try:
                state.zentorch = await asyncio.to_thread(zentorch_status)  # off the event loop
                config = EngineConfig(
                    PoolConfig(workers=settings.worker_count, smt=settings.smt),
                    max_work=settings.max_work,
                )
                state.engine = PrefillEngine(config)
                await asyncio.to_thread(state.engine.start)
                _serve_regions(state, state.engine)
                state.ready = True
            except Exception as exc:  # reported by /health; the process stays up to say so
                state.start_error = f"{type(exc).__name__}: {exc}"
                log.exception("the engine failed to start")

        starting = asyncio.create_task(start())
        try:
            yield
        finally:
            state.draining, state.ready = True, False
            await starting
            if state.region_server is not None:
                state.region_server.close()
            if state.engine is not None:
                await asyncio.to_thread(state.engine.close, settings.drain_timeout_s)

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
        workers = state.engine.workers() if state.engine is not None else []
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
    workers = state.engine.workers() if state.engine is not None else []
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
        "lse_kernel": status.get("lse_kernel"),
        "lse_kernel_reason": status.get("lse_reason"),
        "shared_memory": (
            {"socket": state.region_server.path, "instance": state.instance}
            if state.region_server is not None
            else None
        ),
        "cpu": status.get("cpu"),
        "workers": workers,
        "inflight": a.inflight,
        "uploads": a.uploads,
        "queued": a.queued,
        "inflight_bytes": a.inflight_bytes,
        "error": state.start_error,
    }
    return JSONResponse(body, status_code=200 if word in ("ok", "degraded") else 503)


def _serve_regions(state: ServiceState, engine: PrefillEngine) -> None:
    """Listen for same-host regions where the settings offer them (on the event loop)."""
    s = state.settings
    path = s.regions_socket
    if path is None:
        return
    registry = RegionRegistry(
        max_regions=s.shm_max_regions, max_bytes=s.shm_max_bytes, adopt=engine.adopt
    )
    server = RegionServer(
        path,
        registry,
        token=s.api_token.get_secret_value() if s.api_token is not None else None,
        max_clients=s.shm_max_clients,
        instance=state.instance,
    )
    server.start()
    state.regions, state.region_server = registry, server


def _gate(state: ServiceState, request: Request) -> PrefillEngine:
    """Checks every prefill passes first: serving, ready, the token."""
    s = state.settings
    if state.draining:
        raise ServiceUnavailableError("the service is draining for shutdown", retry_after=5)
    if not state.ready or state.engine is None:
        raise ServiceUnavailableError(
            state.start_error or "the worker pool is starting", retry_after=5
        )
    if s.api_token is not None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        good = s.api_token.get_secret_value().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), good):
            raise UnauthorizedError("a valid bearer token is required (Authorization: Bearer ...)")
    return state.engine


def _admit(state: ServiceState, request: Request, limit: int) -> Ticket:
    """Checks made before a byte of the body is read; the request's share of the admission."""
    length = request.headers.get("content-length")
    if length is None or not length.isdigit():
        raise LengthRequiredError("Content-Length: expected the body size in bytes, got none")
    n = int(length)
    if n > limit:
        raise BodyTooLargeError(f"Content-Length: expected at most {limit} bytes, got {n}")
    state.admission.check_queue()  # a full queue now is a 429 now, not after the upload
    return state.admission.admit(n)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _ClientGoneError(Exception):
    """The client closed the connection while its work ran (answered 499, for metrics)."""


@dataclass
class _Exchange:
    """One /prefill as the log line and the metrics see it."""

    t0: float = field(default_factory=time.perf_counter)
    request_id: str | None = None
    status: int = 500
    bytes_in: int = 0
    bytes_out: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    buf: SharedBuffer | None = None  # the body's buffer, until handed back
    ticket: Ticket | None = None


async def _prefill(state: ServiceState, request: Request) -> Response:
    x = _Exchange()
    try:
        engine = _gate(state, request)
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media == region_request.MEDIA_TYPE and state.regions is not None:
            return await _from_regions(state, request, engine, x)
        if media != "application/octet-stream":
            offered = "application/octet-stream" + (
                f" or {region_request.MEDIA_TYPE}" if state.regions is not None else ""
            )
            raise UnsupportedMediaTypeError(
                f"Content-Type: expected {offered}, got {media or 'none'}"
            )
        return await _from_body(state, request, engine, x)
    except (ClientDisconnect, _ClientGoneError):
        x.status = 499
        return Response(status_code=499)
    except ZenMLAError as exc:
        x.status = status_of(exc)
        # Answered before the whole body came: the connection closes (lingering, see
        # protocol.py) rather than reading an unbounded rest of the body to keep it alive.
        return problem(exc, x.request_id, None if x.bytes_in else {"Connection": "close"})
    except Exception as exc:  # a bug of ours: a 500 problem, never a dropped connection
        log.exception("prefill failed")
        x.status = 500
        return problem(KernelError(f"internal error: {type(exc).__name__}: {exc}"), x.request_id)
    finally:
        if x.buf is not None and state.engine is not None:
            await give_back(state.engine, x.buf)
        if x.ticket is not None:
            x.ticket.close()
        total = time.perf_counter() - x.t0
        state.metrics.observe("total", total)
        state.metrics.count_request(x.status, x.bytes_in, x.bytes_out)
        log.info(
            json.dumps(
                {
                    "event": "prefill",
                    "request_id": x.request_id,
                    "status": x.status,
                    "bytes_in": x.bytes_in,
                    "bytes_out": x.bytes_out,
                    "total_ms": round(total * 1e3, 3),
                    **x.info,
                }
            )
        )


async def _from_body(
    state: ServiceState, request: Request, engine: PrefillEngine, x: _Exchange
) -> Response:
    """A safetensors body: read into shared memory, decoded as views, read there in place."""
    s = state.settings
    x.ticket = _admit(state, request, s.max_body_bytes)
    n = int(request.headers["content-length"])
    loop = asyncio.get_running_loop()
    x.buf = await read_body(
        request.receive,
        n,
        engine,
        min_rate=s.min_body_rate,
        grace_s=s.body_grace_s,
        deadline_at=loop.time() - (time.perf_counter() - x.t0) + s.deadline_s,
        deadline_s=s.deadline_s,
    )
    x.bytes_in = n
    ingest_s = time.perf_counter() - x.t0
    x.ticket.uploaded()
    tensors, meta = wire.decode(x.buf.tensor(0, (n,), torch.uint8), wire.REQUEST_TENSORS)
    x.request_id = meta.get("request_id")
    options = wire.parse_options(meta)
    prepared = engine.prepare_tensors(
        tensors,
        causal=options.causal,
        return_lse=options.return_lse,
        scale=options.scale,
        kernel=options.kernel,
    )
    run = functools.partial(engine.run, prepared, inputs=x.buf)
    result, timing = await _compute(state, request, prepared, run, x)
    held, x.buf = x.buf, None
    await give_back(engine, held)
    response = _send(result, x.request_id)
    x.status, x.bytes_out = 200, int(response.headers["content-length"])
    return _timed(response, ingest_s, *timing, x)


async def _from_regions(
    state: ServiceState, request: Request, engine: PrefillEngine, x: _Exchange
) -> Response:
    """A small JSON body naming places in the client's regions: no tensor byte is read."""
    assert state.regions is not None
    x.ticket = _admit(state, request, wire.MAX_HEADER_BYTES)
    body = await request.body()
    x.bytes_in = len(body)
    ingest_s = time.perf_counter() - x.t0
    x.ticket.uploaded()
    work = resolve_regions(body, state.regions, engine)
    x.request_id = work.options.request_id
    run = functools.partial(engine.run, work.prepared, inputs=work.inputs, outputs=work.outputs)
    result, timing = await _compute(state, request, work.prepared, run, x)
    result.release()  # the client's memory: nothing goes back to a cache
    response = region_answer(work, result.kernels, x.request_id)
    x.status, x.bytes_out = 200, len(response.body)
    return _timed(response, ingest_s, *timing, x)


async def _compute(
    state: ServiceState,
    request: Request,
    prepared: PrefillRequest,
    run: Callable[[], PrefillJob],
    x: _Exchange,
) -> tuple[PrefillResult, tuple[float, float]]:
    """Queue the prepared request and wait for it within the deadline, watching the client;
    the result, and its (queue, compute) seconds."""
    s = state.settings
    x.info = {"tq": prepared.num_q_tokens, "tk": prepared.num_kv_tokens, "b": prepared.num_requests}
    assert x.ticket is not None
    x.ticket.enqueue()
    batch = prepared.batch
    out_bytes = prepared.num_q_tokens * batch.num_heads * batch.v_head_dim * batch.v.element_size()
    if out_bytes > SMALL_BYTES:
        job = await asyncio.to_thread(run)  # the pool may make (pre-fault) `out` at once
    else:
        job = run()
    waiting = asyncio.ensure_future(job.wait(s.deadline_s - (time.perf_counter() - x.t0)))
    gone: asyncio.Future[None] = asyncio.ensure_future(_disconnected(request))
    watch: set[asyncio.Future[Any]] = {waiting, gone}
    await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
    if not waiting.done():
        waiting.cancel()  # abandons the work: its busy workers are stopped and replaced
        raise _ClientGoneError
    gone.cancel()
    result = waiting.result()  # DeadlineExceededError past the deadline
    done_at = time.perf_counter()
    queue_s = (job.started_at or done_at) - job.queued_at
    compute_s = done_at - (job.started_at or done_at)
    state.metrics.observe("queue", queue_s)
    state.metrics.observe("compute", compute_s)
    state.metrics.count_tokens(prepared.num_q_tokens, prepared.num_kv_tokens)
    return result, (queue_s, compute_s)


def _timed(
    response: Response, ingest_s: float, queue_s: float, compute_s: float, x: _Exchange
) -> Response:
    response.headers["Server-Timing"] = (
        f"ingest;dur={ingest_s * 1e3:.3f}, queue;dur={queue_s * 1e3:.3f}, "
        f"compute;dur={compute_s * 1e3:.3f}"
    )
    x.info |= {
        "ingest_ms": round(ingest_s * 1e3, 3),
        "queue_ms": round(queue_s * 1e3, 3),
        "compute_ms": round(compute_s * 1e3, 3),
    }
    return response


def _send(result: PrefillResult, request_id: str | None) -> StreamingResponse:
    """safetensors header, then out and lse straight from the shared memory the workers wrote.

    The memory goes back to the pool only when nothing refers to it any more: the transport
    (uvloop) may keep a chunk it could not write at once and send it after the app is done, so
    release waits for the arrays behind the chunks to be collected, not for the last yield.
    """
    outputs = {"out": result.out} | ({"lse": result.lse} if result.lse is not None else {})
    meta = {"kernel": result.kernels.out}
    if result.kernels.lse is not None:
        meta["lse_kernel"] = result.kernels.lse
    if request_id:
        meta["request_id"] = request_id
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


def _release_when_collected(result: PrefillResult, exporters: list[object]) -> None:
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
