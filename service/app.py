"""The FastAPI app: POST /prefill, GET /health, /health/live, /metrics.

The app owns the worker pool through its lifespan. A request body is read straight into the
pool's shared memory (`ingest`), decoded as views, run by the workers and sent back from the
shared memory the workers wrote; errors leave as problem+json through `problems.problem`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from zen_mla import (
    UnsupportedMediaTypeError,
    ZenMLAError,
    wire,
    zentorch_status,
)
from zen_mla.engine import EngineConfig, PrefillEngine, PrefillResult
from zen_mla.pool import PoolConfig
from zen_mla.regions.registry import RegionRegistry
from zen_mla.regions.server import RegionServer
from zen_mla.wire import regions_json

from .exchange import (
    Exchange,
    ServiceState,
    admit,
    compute,
    drop_body,
    gate,
    handle,
    receive,
    receive_small,
    stream,
    timed,
)
from .kserve import add_routes as add_kserve_routes
from .problems import PROBLEM_RESPONSES, Problem, problem
from .regions import answer as region_answer
from .regions import resolve as resolve_regions
from .settings import Settings
from .system_shm import SystemShmRegistry

log = logging.getLogger("zen_mla.service")


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
                    max_seqs=settings.max_seqs,
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
    add_kserve_routes(app, state)

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
    """Listen for same-host regions, and take system shared memory registrations, where the
    settings offer them (on the event loop)."""
    s = state.settings
    if s.system_shm:
        state.system_shm = SystemShmRegistry(
            max_regions=s.system_shm_max_regions,
            max_bytes=s.system_shm_max_bytes,
            adopt=engine.adopt,
        )
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
        # the HTTP door's rule for a request's head holds for hello and for every frame
        hello_timeout_s=s.header_timeout_s,
        frame_timeout_s=s.header_timeout_s,
        max_unauthenticated=s.shm_max_waiting,
    )
    server.start()
    state.regions, state.region_server = registry, server


async def _prefill(state: ServiceState, request: Request) -> Response:
    async def work(x: Exchange) -> Response:
        engine = gate(state, request)
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media == regions_json.MEDIA_TYPE and state.regions is not None:
            return await _from_regions(state, request, engine, x)
        if media != "application/octet-stream":
            offered = "application/octet-stream" + (
                f" or {regions_json.MEDIA_TYPE}" if state.regions is not None else ""
            )
            raise UnsupportedMediaTypeError(
                f"Content-Type: expected {offered}, got {media or 'none'}"
            )
        return await _from_body(state, request, engine, x)

    def answer_error(exc: ZenMLAError, x: Exchange, headers: dict[str, str] | None) -> Response:
        return problem(exc, x.request_id, headers)

    return await handle(state, "prefill", work, answer_error)


async def _from_body(
    state: ServiceState, request: Request, engine: PrefillEngine, x: Exchange
) -> Response:
    """A safetensors body: read into shared memory, decoded as views, read there in place."""
    s = state.settings
    x.ticket = admit(state, request, s.max_body_bytes)
    buf = await receive(state, request, engine, x)
    n = x.bytes_in
    ingest_s = time.perf_counter() - x.t0
    tensors, meta = wire.decode(buf.tensor(0, (n,), torch.uint8), wire.REQUEST_TENSORS)
    x.request_id = meta.get("request_id")
    options = wire.parse_options(meta)
    prepared = engine.prepare(tensors, options)
    run = functools.partial(engine.run, prepared, inputs=buf)
    result, timing = await compute(state, request, prepared, run, x)
    await drop_body(engine, x)
    response = _send(result, x.request_id)
    x.status, x.bytes_out = 200, int(response.headers["content-length"])
    return timed(response, ingest_s, *timing, x)


async def _from_regions(
    state: ServiceState, request: Request, engine: PrefillEngine, x: Exchange
) -> Response:
    """A small JSON body naming places in the client's regions: no tensor byte is read."""
    assert state.regions is not None
    body = await receive_small(state, request, engine, x, wire.MAX_HEADER_BYTES)
    ingest_s = time.perf_counter() - x.t0
    work = resolve_regions(body, state.regions, engine)
    x.request_id = work.options.request_id
    run = functools.partial(engine.run, work.prepared, inputs=work.inputs, outputs=work.outputs)
    result, timing = await compute(state, request, work.prepared, run, x)
    result.release()  # the client's memory: nothing goes back to a cache
    response = region_answer(work, result.kernels, x.request_id)
    x.status, x.bytes_out = 200, len(response.body)
    return timed(response, ingest_s, *timing, x)


def _send(result: PrefillResult, request_id: str | None) -> StreamingResponse:
    """safetensors header, then out and lse straight from the shared memory the workers wrote
    (`exchange.stream`)."""
    outputs = {"out": result.out} | ({"lse": result.lse} if result.lse is not None else {})
    meta = {"kernel": result.kernels.out}
    if result.kernels.lse is not None:
        meta["lse_kernel"] = result.kernels.lse
    if request_id:
        meta["request_id"] = request_id
    header, chunks = wire.encode(outputs, meta)
    return stream(header, chunks, result, "application/octet-stream")
