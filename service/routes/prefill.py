"""`POST /prefill`, in either body form: a safetensors file (`forms.safetensors`) or a regions
JSON naming places in the client's same-host regions (`forms.regions`), picked by its
Content-Type; both go through the one pipeline (`pipeline.serve`)."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response

from zen_mla.wire import regions_json

from ..doors import HttpDoor
from ..forms.base import Form
from ..forms.regions import RegionsForm
from ..forms.safetensors import SafetensorsForm
from ..pipeline import serve
from ..problems import PROBLEM_RESPONSES
from ..state import ServiceState

__all__ = ["add_routes"]


def add_routes(app: FastAPI, state: ServiceState) -> None:
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
                "__metadata__ causal, return_lse, scale, kernel, request_id; or q, kv_c, k_pe, "
                "... over MLA's latent cache with __metadata__ weight (a registered w_kv_b) and "
                "form",
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def prefill(request: Request) -> Response:
        """Ragged MLA prefill attention (docs/protocol.md)."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        form: Form[Response]
        if media == regions_json.MEDIA_TYPE and state.regions is not None:
            form = RegionsForm(state.regions, state)
        else:
            form = SafetensorsForm(state, media)
        return await serve(state, HttpDoor(request), form)
