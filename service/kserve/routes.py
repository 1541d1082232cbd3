"""The Open Inference Protocol (KServe v2) next to `/prefill`: server and model metadata,
health, `POST /v2/models/mla_prefill/infer` (`kserve.infer.InferForm`), and the system shared
memory extension (off unless `system_shm`; a registration reads its JSON body through the one
pipeline, `kserve.register`; a caller sees and names its own regions only). Errors are the
protocol's (`kserve.errors`).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from zen_mla import ZenMLAError
from zen_mla.regions import CallerShm

from ..doors import HttpDoor
from ..pipeline import serve
from ..state import ServiceState, readiness
from . import request as kr
from .errors import ERROR_RESPONSES, error_response
from .infer import InferForm
from .register import RegisterForm, regions_of

__all__ = ["add_routes"]


def add_routes(app: FastAPI, state: ServiceState) -> None:
    """The /v2 routes on `app`; they answer errors in the protocol's form."""

    # JSON over SMALL_BYTES is read in a thread, one request at a time: its Python objects
    # take some ten times its bytes while they live
    big_json = asyncio.Semaphore(1)

    def guarded(call: Any) -> Any:
        @functools.wraps(call)
        async def wrapper(*args: Any, **kwargs: Any) -> Response:
            try:
                result: Response = await call(*args, **kwargs)
                return result
            except ZenMLAError as exc:
                return error_response(exc)

        return wrapper

    def ready() -> None:
        now = readiness(state)
        if not now.ready:
            raise now.error()

    @app.get("/v2", tags=["v2"], responses=ERROR_RESPONSES)
    @guarded
    async def server_metadata() -> Response:
        """Server metadata: name, version, the protocol extensions served."""
        extensions = ["binary_tensor_data", "parameters"]
        if state.settings.system_shm:
            extensions.append("system_shared_memory")
        return JSONResponse({"name": "zen-mla", "version": app.version, "extensions": extensions})

    @app.get("/v2/health/live", tags=["v2"], responses=ERROR_RESPONSES)
    @guarded
    async def server_live() -> Response:
        """200 while the process runs."""
        return JSONResponse({"live": True})

    @app.get("/v2/health/ready", tags=["v2"], responses=ERROR_RESPONSES)
    @guarded
    async def server_ready() -> Response:
        """200 when a worker can take work, else 503."""
        ready()
        return JSONResponse({"ready": True})

    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):

        @app.get(prefix, tags=["v2"], responses=ERROR_RESPONSES)
        @guarded
        async def model_metadata(model: str, version: str = "") -> Response:
            """The model's inputs and outputs."""
            kr.check_model(model, version)
            return JSONResponse(kr.model_metadata())

        @app.get(prefix + "/ready", tags=["v2"], responses=ERROR_RESPONSES)
        @guarded
        async def model_ready(model: str, version: str = "") -> Response:
            """200 when the model can take requests (a worker is alive), else 503."""
            kr.check_model(model, version)
            ready()
            return JSONResponse({"name": kr.MODEL, "ready": True})

        @app.post(
            prefix + "/infer",
            tags=["v2"],
            responses={
                200: {
                    "description": "the inference response: JSON, then binary tensor data "
                    "when Inference-Header-Content-Length is set",
                    "content": {"application/json": {}, "application/octet-stream": {}},
                },
                **ERROR_RESPONSES,
            },
            openapi_extra={
                "requestBody": {
                    "required": True,
                    "description": "an inference request (JSON), then binary tensor data when "
                    "the Inference-Header-Content-Length header says where the JSON ends",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "application/octet-stream": {
                            "schema": {"type": "string", "format": "binary"}
                        },
                    },
                }
            },
        )
        async def infer(request: Request, model: str, version: str = "") -> Response:
            """Ragged MLA prefill attention (docs/protocol.md), as the mla_prefill model."""
            form = InferForm(request, model, version, state, big_json)
            return await serve(state, HttpDoor(request), form)

    shm = "/v2/systemsharedmemory"

    def regions(request: Request) -> CallerShm:
        """The caller's regions, its token checked: a tenant sees and names its own only."""
        door = HttpDoor(request)
        door.authorize(state.tenants)
        return regions_of(state, door)

    @app.get(shm + "/status", tags=["v2"], responses=ERROR_RESPONSES)
    @app.get(shm + "/region/{name}/status", tags=["v2"], responses=ERROR_RESPONSES)
    @guarded
    async def shm_status(request: Request, name: str | None = None) -> Response:
        """The caller's registered regions (or one): name, key, offset, byte_size."""
        return JSONResponse(regions(request).status(name))

    @app.post(shm + "/region/{name}/register", tags=["v2"], responses=ERROR_RESPONSES)
    async def shm_register(request: Request, name: str) -> Response:
        """Register `byte_size` bytes from `offset` of the /dev/shm object `key` as the
        caller's region `name`."""
        return await serve(state, HttpDoor(request), RegisterForm(state, name))

    @app.post(shm + "/unregister", tags=["v2"], responses=ERROR_RESPONSES)
    @app.post(shm + "/region/{name}/unregister", tags=["v2"], responses=ERROR_RESPONSES)
    @guarded
    async def shm_unregister(request: Request, name: str | None = None) -> Response:
        """Unregister one of the caller's regions, or all of them."""
        regions(request).unregister(name)
        return JSONResponse({})
