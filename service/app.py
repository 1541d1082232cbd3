"""The FastAPI app: the service's state built, its routes mounted (`routes`: /health, /metrics,
/prefill; `kserve`: /v2), and its lifespan, which starts the engine (unless one is given) and
the same-host region socket, and drains and closes them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response

from zen_mla import ZenMLAError, __version__, host_kernels
from zen_mla.engine import EngineConfig, PoolConfig, PrefillEngine
from zen_mla.regions import RegionRegistry, RegionServer, SystemShmRegistry

from .kserve import routes as kserve
from .problems import Problem, problem
from .routes import health, prefill, weights
from .routes.calls import socket_calls, socket_ended
from .settings import Settings
from .state import ServiceState
from .weights import Weights

__all__ = ["create_app"]

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
        state.kernels = host_kernels()  # probed already when the engine was made

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            _serve_regions(state, engine)
            try:
                yield
            finally:
                _close(state)
            return

        async def start() -> None:
            try:
                state.kernels = await asyncio.to_thread(host_kernels)  # off the event loop
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
            _close(state)
            if state.engine is not None:
                await asyncio.to_thread(state.engine.close, settings.drain_timeout_s)

    app = FastAPI(title="zen-mla", version=__version__, lifespan=lifespan)
    app.state.service = state
    kserve.add_routes(app, state)
    health.add_routes(app, state)
    prefill.add_routes(app, state)
    weights.add_routes(app, state)

    @app.exception_handler(ZenMLAError)
    async def _zen_error(request: Request, exc: ZenMLAError) -> Response:
        return problem(exc)

    # the Problem schema, referenced from every problem+json response of the routes
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


def _close(state: ServiceState) -> None:
    """The region socket closed and the weights let go, before the engine closes."""
    if state.region_server is not None:
        state.region_server.close()
    if state.weights is not None:
        state.weights.close()


def _serve_regions(state: ServiceState, engine: PrefillEngine) -> None:
    """Take weights, listen for same-host regions, and take system shared memory
    registrations, where the settings offer them (on the event loop)."""
    s = state.settings
    state.weights = Weights(engine, s.max_weights, s.max_inflight_bytes // 2)
    if s.system_shm:
        state.system_shm = SystemShmRegistry(
            max_regions=s.system_shm_max_regions,
            max_bytes=s.system_shm_max_bytes,
            adopt=engine.adopt,
            by_caller=state.tenants.named,  # each tenant its own regions
        )
    path = s.regions_socket
    if path is None:
        return
    registry = RegionRegistry(
        max_regions=s.shm_max_regions,
        max_bytes=s.shm_max_bytes,
        max_total_bytes=s.shm_max_total_bytes,
        adopt=engine.adopt,
    )
    server = RegionServer(
        path,
        registry,
        authorize=state.tenants.caller if state.tenants.required else None,
        max_clients=s.shm_max_clients,
        instance=state.instance,
        # the HTTP door's rule for a request's head holds for hello and for every frame
        hello_timeout_s=s.header_timeout_s,
        frame_timeout_s=s.header_timeout_s,
        max_unauthenticated=s.shm_max_waiting,
        calls=socket_calls(state),  # prefill calls on the socket, with no HTTP on their way
        ended=socket_ended(state),  # a connection's weights end with it
    )
    server.start()
    state.regions, state.region_server = registry, server
