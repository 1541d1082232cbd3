"""A safetensors `/prefill` body (`SafetensorsForm`): read straight into the pool's shared
memory by the one body reader, decoded as views, read there in place by the workers, and
answered with a safetensors file streamed from the shared memory the workers wrote. Errors
leave as problem+json (`problems`).

A body with `kv_c` and `k_pe` in place of `k` and `v` is a request over MLA's latent cache: its
`__metadata__.weight` names one of its caller's registered weights (`service.weights`), leased
for the work and read in place from its own buffer."""

from __future__ import annotations

import torch
from fastapi import Response

from zen_mla import UnsupportedMediaTypeError, ZenMLAError, wire
from zen_mla.caller import Caller
from zen_mla.engine import PrefillEngine, SharedBuffer
from zen_mla.wire import regions_json

from ..answer import answer_metadata, server_timing, stream
from ..doors import Door
from ..problems import problem
from ..settings import Settings
from ..state import ServiceState
from .base import Computed, Expect, Form, RequestRecord, Work
from .weight import latent_lease

_TENSORS = wire.REQUEST_TENSORS | wire.LATENT_TENSORS

__all__ = ["SafetensorsForm", "send"]


class SafetensorsForm(Form[Response]):
    """A safetensors body: read into shared memory, decoded as views, read there in place; the
    answer a safetensors file streamed from the shared memory the workers wrote."""

    route = "prefill"

    def __init__(self, state: ServiceState, media: str) -> None:
        self.state = state
        self.media = media
        self.regions_offered = state.regions is not None
        self.caller: Caller | None = None

    def expect(self, settings: Settings, door: Door) -> Expect:
        if self.media != "application/octet-stream":
            offered = "application/octet-stream" + (
                f" or {regions_json.MEDIA_TYPE}" if self.regions_offered else ""
            )
            raise UnsupportedMediaTypeError(
                f"Content-Type: expected {offered}, got {self.media or 'none'}"
            )
        self.caller = door.caller
        return Expect(settings.max_body_bytes)

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> Work:
        assert isinstance(body, SharedBuffer)
        n = record.bytes_in
        tensors, meta = wire.decode(body.tensor(0, (n,), torch.uint8), _TENSORS)
        record.request_id = meta.get("request_id")
        options = wire.parse_options(meta, latent=True)
        weight, leases = latent_lease(self.state, self.caller, options, tensors)
        return Work(tensors, options, inputs=[body, *weight], leases=leases)

    async def answer(self, result: Computed | None, record: RequestRecord) -> Response:
        assert result is not None
        response = send(result, record.request_id)
        record.bytes_out = int(response.headers["content-length"])
        return server_timing(response, record)

    def refuse(self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]) -> Response:
        return problem(exc, record.request_id, headers)

    def hung_up(self) -> Response:
        return Response(status_code=499)


def send(result: Computed, request_id: str | None) -> Response:
    """safetensors header, then out and lse straight from the shared memory the workers wrote
    (`answer.stream`)."""
    outputs = {"out": result.out} | ({"lse": result.lse} if result.lse is not None else {})
    header, chunks = wire.encode(outputs, answer_metadata(result.kernels, request_id))
    return stream(header, chunks, result, "application/octet-stream")
