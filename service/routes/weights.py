"""`/weights`: a caller's registered weights (a layer's `kv_b_proj`, named by requests over
MLA's latent cache). `PUT /weights/{name}` reads its body through the one pipeline
(`forms.weight`); listing and forgetting read no body, the caller's token checked as any
request's. A caller sees and names its own weights only."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from zen_mla import ZenMLAError, wire

from ..doors import HttpDoor
from ..forms.weight import WeightForm, weights_of
from ..pipeline import serve
from ..problems import PROBLEM_RESPONSES, problem
from ..state import ServiceState

__all__ = ["add_routes"]


def add_routes(app: FastAPI, state: ServiceState) -> None:
    def caller_of(request: Request) -> HttpDoor:
        door = HttpDoor(request)
        door.authorize(state.tenants)
        return door

    @app.put(
        "/weights/{name}",
        tags=["weights"],
        responses=PROBLEM_RESPONSES,
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": "safetensors: one tensor w_kv_b [H * (qk_nope_dim + v_head_dim), "
                "kv_lora_rank] (kv_b_proj's weight, out x in)",
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def register(request: Request, name: str) -> Response:
        """Register (or replace) the caller's weight `name`: its name, shape, dtype, bytes."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        return await serve(state, HttpDoor(request), WeightForm(state, media, name))

    @app.api_route(
        "/weights/{name}",
        methods=["GET", "HEAD", "POST", "PATCH", "OPTIONS", "TRACE"],
        include_in_schema=False,
    )
    async def other(name: str) -> Response:
        """405 naming both methods a weight takes (two routes of one path each name their own:
        Starlette answers a method neither takes with the first one's alone)."""
        return Response(status_code=405, headers={"Allow": "PUT, DELETE"})

    @app.get("/weights", tags=["weights"], responses=PROBLEM_RESPONSES)
    async def listed(request: Request) -> Response:
        """The caller's weights: name, shape, dtype, bytes."""
        try:
            door = caller_of(request)
            return JSONResponse(weights_of(state).listed(door.caller))
        except ZenMLAError as exc:
            return problem(exc)

    @app.delete("/weights/{name}", tags=["weights"], responses=PROBLEM_RESPONSES)
    async def forget(request: Request, name: str) -> Response:
        """Forget the caller's weight `name` (its memory goes back once the work using it
        ends)."""
        try:
            door = caller_of(request)
            wire.check_weight_name("name", name)
            weights_of(state).forget(door.caller, name)
            return Response(status_code=204)
        except ZenMLAError as exc:
            return problem(exc)
