"""`POST /prefill`, in either body form: a safetensors file (read straight into the pool's
shared memory by the one body reader, decoded as views, read there in place by the workers, and
answered from the shared memory the workers wrote), or a regions JSON naming places in the
client's same-host regions (`routes.regions`). Errors leave as problem+json (`problems`)."""

from __future__ import annotations

import functools
import time

import torch
from fastapi import FastAPI, Request, Response

from zen_mla import UnsupportedMediaTypeError, ZenMLAError, wire
from zen_mla.engine import PrefillEngine, PrefillResult
from zen_mla.wire import regions_json

from ..answer import stream
from ..exchange import (
    Exchange,
    admit,
    answer_metadata,
    compute,
    disconnected,
    drop_body,
    gate,
    handle,
    receive,
    receive_small,
    timed,
)
from ..problems import PROBLEM_RESPONSES, problem
from ..state import ServiceState
from .regions import answer, resolve

__all__ = ["add_routes", "send"]


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
    result, timing = await compute(state, disconnected(request), prepared, run, x)
    await drop_body(engine, x)
    response = send(result, x.request_id)
    x.status, x.bytes_out = 200, int(response.headers["content-length"])
    return timed(response, ingest_s, *timing, x)


async def _from_regions(
    state: ServiceState, request: Request, engine: PrefillEngine, x: Exchange
) -> Response:
    """A small JSON body naming places in the client's regions: no tensor byte is read."""
    assert state.regions is not None
    body = await receive_small(state, request, engine, x, wire.MAX_HEADER_BYTES)
    ingest_s = time.perf_counter() - x.t0
    work = resolve(body, state.regions, engine)
    x.request_id = work.options.request_id
    run = functools.partial(engine.run, work.prepared, inputs=work.inputs, outputs=work.outputs)
    result, timing = await compute(state, disconnected(request), work.prepared, run, x)
    result.release()  # the client's memory: nothing goes back to a cache
    response = answer(work, result.kernels, x.request_id)
    x.status, x.bytes_out = 200, len(response.body)
    return timed(response, ingest_s, *timing, x)


def send(result: PrefillResult, request_id: str | None) -> Response:
    """safetensors header, then out and lse straight from the shared memory the workers wrote
    (`answer.stream`)."""
    outputs = {"out": result.out} | ({"lse": result.lse} if result.lse is not None else {})
    header, chunks = wire.encode(outputs, answer_metadata(result.kernels, request_id))
    return stream(header, chunks, result, "application/octet-stream")
