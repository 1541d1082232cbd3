"""The Open Inference Protocol (KServe v2) next to `/prefill`: server and model metadata,
health, `POST /v2/models/mla_prefill/infer` with the binary tensor data extension, and the
system shared memory extension (off unless `system_shm`).

An infer request goes the way a `/prefill` does (`exchange`): the same gate, token, admission,
body limits and rate, deadline, queue and metrics. Its body is read into the pool's shared
memory shifted so that the binary tensor data after the JSON starts cache-line aligned; q, k
and v there are read in place by the workers. Errors are `{"error": "..."}` with the status
`/prefill` would give, which tritonclient raises as InferenceServerException with our message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import time
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from zen_mla import (
    BodyTooLargeError,
    ForbiddenError,
    InvalidInputError,
    KernelError,
    NotFoundError,
    ServiceUnavailableError,
    UnsupportedMediaTypeError,
    WireFormatError,
    ZenMLAError,
    status_of,
)
from zen_mla.engine import PrefillEngine, PrefillRequest, PrefillResult
from zen_mla.pool import Outputs, SharedBuffer
from zen_mla.wire import tensor_bytes
from zen_mla.wire.dtypes import BY_TORCH

from . import kserve_request as kr
from .exchange import (
    Exchange,
    ServiceState,
    admit,
    authorize,
    byte_count,
    compute,
    content_length,
    drop_body,
    gate,
    handle,
    receive,
    receive_small,
    stream,
    timed,
)
from .ingest import SMALL_BYTES
from .problems import problem_headers
from .system_shm import SystemRegion, SystemShmRegistry

__all__ = ["add_routes", "error_response"]

ALIGN = 64  # the binary tensor data starts on a cache line
JSON_BYTES_PER_NUMBER = 16  # a generous estimate of one number written as JSON
HEADER_LENGTH = "inference-header-content-length"
REGISTER_BYTES = 64 << 10  # a system shared memory registration's JSON, at most

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {
        "description": "an error, as the Open Inference Protocol gives it",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}},
                    "required": ["error"],
                }
            }
        },
    }
    for status in (400, 401, 403, 404, 408, 411, 413, 415, 422, 429, 500, 503, 504)
}


def error_response(exc: ZenMLAError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": str(exc)},
        status_code=status_of(exc),
        headers=problem_headers(exc) | dict(headers or {}),
    )


def _answer_error(exc: ZenMLAError, x: Exchange, headers: dict[str, str] | None) -> Response:
    return error_response(exc, headers)


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
        engine = state.engine
        if state.draining:
            raise ServiceUnavailableError("the service is draining for shutdown")
        if not state.ready or engine is None:
            raise ServiceUnavailableError(state.start_error or "the worker pool is starting")
        if not engine.ready():
            raise ServiceUnavailableError("no worker is alive; they are being replaced")

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
            _model(model, version)
            return JSONResponse(kr.model_metadata())

        @app.get(prefix + "/ready", tags=["v2"], responses=ERROR_RESPONSES)
        @guarded
        async def model_ready(model: str, version: str = "") -> Response:
            """200 when the model can take requests (a worker is alive), else 503."""
            _model(model, version)
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
            """Ragged MLA prefill attention (CONTRACT.md), as the mla_prefill model."""
            return await handle(
                state,
                "v2",
                functools.partial(_infer, state, big_json, request, model, version),
                _answer_error,
            )

    shm = "/v2/systemsharedmemory"

    def registry(request: Request) -> SystemShmRegistry:
        authorize(state, request)
        if not state.settings.system_shm:
            raise _shm_off()
        if state.system_shm is None:
            raise ServiceUnavailableError(
                state.start_error or "the worker pool is starting", retry_after=5
            )
        return state.system_shm

    @app.get(shm + "/status", tags=["v2"], responses=ERROR_RESPONSES)
    @app.get(shm + "/region/{name}/status", tags=["v2"], responses=ERROR_RESPONSES)
    @guarded
    async def shm_status(request: Request, name: str | None = None) -> Response:
        """The registered regions (or one): name, key, offset, byte_size."""
        return JSONResponse(registry(request).status(name))

    @app.post(shm + "/region/{name}/register", tags=["v2"], responses=ERROR_RESPONSES)
    async def shm_register(request: Request, name: str) -> Response:
        """Register `byte_size` bytes from `offset` of the /dev/shm object `key` as `name`."""

        async def work(x: Exchange) -> Response:
            regions = registry(request)
            assert state.engine is not None  # regions exist once the engine started
            raw = await receive_small(state, request, state.engine, x, REGISTER_BYTES)
            body = kr.parse_header(raw)
            if not isinstance(body, dict):
                raise WireFormatError("register", "a JSON object", type(body).__name__)
            unknown = sorted(set(body) - {"key", "offset", "byte_size"})
            if unknown:
                raise InvalidInputError("register", "key, offset, byte_size", repr(unknown[0])[:40])
            regions.register(name, body.get("key"), body.get("offset", 0), body.get("byte_size"))
            x.status = 200
            return JSONResponse({})

        return await handle(state, "v2_register", work, _answer_error)

    @app.post(shm + "/unregister", tags=["v2"], responses=ERROR_RESPONSES)
    @app.post(shm + "/region/{name}/unregister", tags=["v2"], responses=ERROR_RESPONSES)
    @guarded
    async def shm_unregister(request: Request, name: str | None = None) -> Response:
        """Unregister one region, or all."""
        registry(request).unregister(name)
        return JSONResponse({})


def _model(model: str, version: str) -> None:
    if model != kr.MODEL:
        raise NotFoundError(f"no model named {model[:80]!r} here; this server serves {kr.MODEL}")
    if version not in ("", kr.VERSION):
        raise NotFoundError(f"model {kr.MODEL} has version {kr.VERSION} only, not {version[:20]!r}")


def _shm_off() -> ForbiddenError:
    return ForbiddenError(
        "system shared memory is off on this server: it lets a client name /dev/shm objects "
        "for the service to read and write; start it with ZEN_MLA_SYSTEM_SHM=true to offer it"
    )


def _header_length(request: Request, n: int) -> int:
    """Where the JSON ends: Inference-Header-Content-Length, else the whole body."""
    raw = request.headers.get(HEADER_LENGTH)
    if raw is None:
        return n
    count = byte_count(raw)
    if count is None or count > n:
        raise WireFormatError(
            "Inference-Header-Content-Length", f"a byte count up to the body's {n}", repr(raw[:40])
        )
    return count


async def _infer(
    state: ServiceState,
    big_json: asyncio.Semaphore,
    request: Request,
    model: str,
    version: str,
    x: Exchange,
) -> Response:
    _model(model, version)
    engine = gate(state, request)
    s = state.settings
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaTypeError(
            f"Content-Encoding: expected identity (bodies are read as sent), got {encoding}"
        )
    x.ticket = admit(state, request, s.max_body_bytes)
    n = content_length(request)
    json_bytes = _header_length(request, n)
    if json_bytes > s.max_json_bytes:
        raise BodyTooLargeError(
            f"inference header: expected at most {s.max_json_bytes} bytes of JSON, got "
            f"{json_bytes}; send tensors as binary data (binary_data_size)"
        )
    lead = -json_bytes % ALIGN
    buf = await receive(state, request, engine, x, lead)
    ingest_s = time.perf_counter() - x.t0
    raw = bytes(buf.bytes_view[lead : lead + json_bytes])
    req, tensors = await _read_request(raw, n - json_bytes, big_json)
    del raw
    x.request_id = req.id
    if req.uses_shm and not s.system_shm:
        raise _shm_off()
    tensors |= _inputs(engine, req, buf, lead + json_bytes, state.system_shm)
    homes, staging = _place_inputs(engine, tensors, buf, req, state.system_shm)
    if staging is not None:
        x.staging.append(staging)  # given back with the body, once the work is done
    prepared = engine.prepare(tensors, req.options)
    places = _output_places(req, prepared, state.system_shm, s.max_json_bytes)
    direct = _direct_outputs(req, places)
    run = functools.partial(engine.run, prepared, inputs=homes, outputs=direct)
    try:
        result, timing = await compute(state, request, prepared, run, x)
    except KernelError:
        _check_regions(req, state.system_shm)  # a worker failed on a region shrunk meanwhile
        raise
    await drop_body(engine, x)
    response = await _respond(req, result, places, direct is not None)
    x.status = 200
    x.bytes_out = int(response.headers.get("content-length", 0))
    return timed(response, ingest_s, *timing, x)


# -- inputs ------------------------------------------------------------------------------------


async def _read_request(
    raw: bytes, binary_bytes: int, big_json: asyncio.Semaphore
) -> tuple[kr.InferRequest, dict[str, torch.Tensor]]:
    """The request, and its inputs given as JSON data as tensors (the request keeps no JSON
    numbers: they are dropped once converted)."""

    def read() -> tuple[kr.InferRequest, dict[str, torch.Tensor]]:
        req = kr.parse_request(kr.parse_header(raw), binary_bytes)
        loaded = {n: _from_json(i) for n, i in req.inputs.items() if i.data is not None}
        for name in loaded:
            req.inputs[name] = dataclasses.replace(req.inputs[name], data=None)
        return req, loaded

    if len(raw) <= SMALL_BYTES:
        return read()
    async with big_json:
        return await asyncio.to_thread(read)


def _inputs(
    engine: PrefillEngine,
    req: kr.InferRequest,
    buf: SharedBuffer,
    data_at: int,
    regions: SystemShmRegistry | None,
) -> dict[str, torch.Tensor]:
    """Each input given as binary data or in a region as a tensor: views of the body's buffer
    or of the region (read by the workers only), copies where they must be (misaligned, or
    cu_seq_lens from a region, read here)."""
    tensors = {}
    for name, spec in req.inputs.items():
        if spec.binary is not None:
            at = data_at + spec.binary
            if at % spec.dtype.itemsize == 0:
                tensors[name] = buf.tensor(at, spec.shape, spec.dtype)
            else:  # misaligned by the inputs before it: a copy
                raw = buf.tensor(at, (spec.nbytes,), torch.uint8).clone()
                tensors[name] = raw.view(spec.dtype).view(spec.shape)
        elif spec.shm is not None:
            assert regions is not None
            region = _region(regions, name, spec.shm, spec.nbytes, spec.dtype)
            if name.endswith("seq_lens"):  # read here: by pread, never through the mapping
                engine.check_num_seqs(name, spec.shape[0])  # before reading a byte of it
                data = region.read(name, spec.shm.offset, spec.nbytes)
                tensors[name] = _from_bytes(data, spec.dtype, spec.shape)
            else:
                tensors[name] = region.view(spec.shm.offset, spec.shape, spec.dtype)
    return tensors


def _check_regions(req: kr.InferRequest, regions: SystemShmRegistry | None) -> None:
    """Every region the request names still holds its registered range (InvalidInputError,
    naming the tensor, where one does not)."""
    if regions is None:
        return
    places = [(n, i.shm) for n, i in req.inputs.items()] + [(o.name, o.shm) for o in req.outputs]
    for name, place in places:
        if place is None:
            continue
        try:
            region = regions.resolve(name, place.region)
        except InvalidInputError:
            continue  # unregistered meanwhile: its mapping lived on until the request ended
        region.check_size(name)


def _region(
    regions: SystemShmRegistry, name: str, place: kr.ShmPlace, nbytes: int, dtype: torch.dtype
) -> SystemRegion:
    """The region `place` names, its range checked against the registration and the object's
    size now."""
    region = regions.resolve(f"{name}.shared_memory_region", place.region)
    end = place.offset + nbytes
    if end > region.byte_size:
        raise InvalidInputError(
            name,
            f"bytes [{place.offset}, {end}) inside region {region.name!r} of {region.byte_size} "
            "bytes",
            f"a range past its end by {end - region.byte_size} bytes",
        )
    if (region.offset + place.offset) % dtype.itemsize:
        raise InvalidInputError(
            f"{name}.shared_memory_offset",
            f"a multiple of {dtype.itemsize} bytes from the object's start",
            str(place.offset),
        )
    region.check_size(name)
    return region


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


def _from_json(spec: kr.InputSpec) -> torch.Tensor:
    whole = not spec.dtype.is_floating_point
    try:
        array = np.asarray(spec.data)
    except (ValueError, TypeError, OverflowError, RecursionError):
        array = np.asarray(None)
    kinds = "iu" if whole else "iuf"
    if array.size and array.dtype.kind not in kinds:
        raise InvalidInputError(
            f"{spec.name}.data",
            "a list of " + ("whole numbers" if whole else "numbers") + " (flat or nested)",
            "other values" if array.dtype.kind in "OSUb" else str(array.dtype),
        )
    count = math.prod(spec.shape)
    if array.size != count:
        raise InvalidInputError(
            f"{spec.name}.data",
            f"{count} numbers ({spec.datatype} {list(spec.shape)})",
            f"{array.size}",
        )
    flat = array.reshape(-1).astype(np.int64 if whole else np.float32)
    return torch.from_numpy(flat).to(spec.dtype).view(spec.shape)


def _place_inputs(
    engine: PrefillEngine,
    tensors: dict[str, torch.Tensor],
    body: SharedBuffer,
    req: kr.InferRequest,
    regions: SystemShmRegistry | None,
) -> tuple[list[SharedBuffer], SharedBuffer | None]:
    """The buffers q, k and v lie in; where some lie in a region and others in none (JSON
    data, copies), those others are staged into a buffer of ours first (returned second, for
    the caller to release): the pool would stage all three, reading the region here."""
    given = [body]
    for name in ("q", "k", "v"):
        place = req.inputs[name].shm
        if place is not None and regions is not None:
            given.append(regions.resolve(name, place.region).buffer)
    loose = [n for n in ("q", "k", "v") if not any(b.contains(tensors[n]) for b in given)]
    if not loose or len(given) == 1:
        return given, None  # all in place, or the pool stages them from ordinary memory
    sizes = [-(-tensors[n].nbytes // ALIGN) * ALIGN for n in loose]
    staging = engine.buffer(sum(sizes))
    at = 0
    for name, size in zip(loose, sizes, strict=True):
        t = tensors[name]
        tensors[name] = staging.tensor(at, tuple(t.shape), t.dtype).copy_(t)
        at += size
    return [*given, staging], staging


# -- outputs -----------------------------------------------------------------------------------


def _output_places(
    req: kr.InferRequest,
    prepared: PrefillRequest,
    regions: SystemShmRegistry | None,
    max_json_bytes: int,
) -> dict[str, tuple[SystemRegion, torch.Size, torch.dtype] | None]:
    """Each requested output's region (None: in the response), every range checked, and the
    JSON ones within the JSON cap."""
    batch = prepared.batch
    shapes = {
        "out": (torch.Size((batch.q.shape[0], batch.num_heads, batch.v_head_dim)), batch.v.dtype),
        "lse": (torch.Size((batch.num_heads, batch.q.shape[0])), torch.float32),
    }
    places: dict[str, tuple[SystemRegion, torch.Size, torch.dtype] | None] = {}
    spans: list[tuple[str, tuple[int, int], int, int]] = []
    for name, spec in req.inputs.items():
        if spec.shm is not None and regions is not None:
            region = regions.resolve(name, spec.shm.region)
            start = region.offset + spec.shm.offset
            spans.append((name, region.inode, start, start + spec.nbytes))
    for out in req.outputs:
        shape, dtype = shapes[out.name]
        nbytes = math.prod(shape) * dtype.itemsize
        if out.shm is None:
            numbers = math.prod(shape)
            if not out.binary and numbers * JSON_BYTES_PER_NUMBER > max_json_bytes:
                raise InvalidInputError(
                    f"{out.name}.binary_data",
                    f"true for an output of {numbers} numbers (as JSON it would pass the "
                    f"{max_json_bytes} byte cap)",
                    "false",
                )
            places[out.name] = None
            continue
        assert regions is not None
        if out.shm.byte_size < nbytes:
            raise InvalidInputError(
                f"{out.name}.shared_memory_byte_size",
                f"at least {nbytes} bytes ({BY_TORCH[dtype].kserve} {list(shape)})",
                str(out.shm.byte_size),
            )
        region = _region(regions, out.name, out.shm, out.shm.byte_size, dtype)
        start = region.offset + out.shm.offset
        for other, inode, a, b in spans:
            if inode == region.inode and start < b and a < start + nbytes:
                raise InvalidInputError(
                    out.name,
                    f"bytes overlapping no other tensor ({other}: [{a}, {b}) of {region.key})",
                    f"[{start}, {start + nbytes})",
                )
        spans.append((out.name, region.inode, start, start + nbytes))
        places[out.name] = (region, shape, dtype)
    return places


def _direct_outputs(
    req: kr.InferRequest,
    places: dict[str, tuple[SystemRegion, torch.Size, torch.dtype] | None],
) -> Outputs | None:
    """Where the workers write when every output computed goes to one region (no copy): that
    region's buffer and the views; else None (the pool's buffer, then pwrite)."""
    computed = ("out", "lse") if req.return_lse else ("out",)
    chosen = [places.get(n) for n in computed]
    regions = {id(p[0]) for p in chosen if p is not None}
    if None in chosen or len(regions) != 1:
        return None
    views = {}
    for name, place in zip(computed, chosen, strict=True):
        assert place is not None
        region, shape, dtype = place
        spec = next(o for o in req.outputs if o.name == name)
        assert spec.shm is not None
        views[name] = region.view(spec.shm.offset, tuple(shape), dtype)
    first = chosen[0]
    assert first is not None
    return first[0].buffer, views["out"], views.get("lse")


async def _respond(
    req: kr.InferRequest,
    result: PrefillResult,
    places: dict[str, tuple[SystemRegion, torch.Size, torch.dtype] | None],
    written: bool,
) -> Response:
    """The response: outputs in regions (written by pwrite unless the workers wrote them),
    binary after the JSON, or as JSON numbers."""
    meta = {"kernel": result.kernels.out}
    if result.kernels.lse is not None:
        meta["lse_kernel"] = result.kernels.lse
    tensors = {"out": result.out, "lse": result.lse}
    entries, chunks = [], []
    try:
        for out in req.outputs:
            t = tensors[out.name]
            assert t is not None
            entry: dict[str, Any] = {
                "name": out.name,
                "datatype": BY_TORCH[t.dtype].kserve,
                "shape": list(t.shape),
            }
            place = places[out.name]
            if place is not None:
                assert out.shm is not None
                if not written:
                    data = tensor_bytes(t)
                    if data.nbytes > SMALL_BYTES:
                        await asyncio.to_thread(place[0].write, out.shm.offset, data)
                    else:
                        place[0].write(out.shm.offset, data)
                entry["parameters"] = {
                    "shared_memory_region": out.shm.region,
                    "shared_memory_offset": out.shm.offset,
                    "shared_memory_byte_size": t.nbytes,
                }
            elif out.binary:
                data = tensor_bytes(t)
                entry["parameters"] = {"binary_data_size": data.nbytes}
                chunks.append(data)
            else:
                entry["data"] = await asyncio.to_thread(_json_numbers, out.name, t)
            entries.append(entry)
        head = kr.response_header(req, entries, meta)
    except BaseException:
        result.release()
        raise
    if not chunks:
        result.release()
        return Response(head, media_type="application/json")
    return stream(
        head,
        chunks,
        result,
        "application/octet-stream",
        {"Inference-Header-Content-Length": str(len(head))},
    )


def _json_numbers(name: str, t: torch.Tensor) -> list[Any]:
    """The numbers of `t` for a JSON answer; JSON has no infinities or NaN (the LSE of a query
    that sees no key is -inf), so such an output must be asked for as binary data."""
    flat = t.reshape(-1).float()
    if not bool(torch.isfinite(flat).all()):
        raise InvalidInputError(
            f"{name}.binary_data",
            f"true: {name} holds -inf, inf or NaN (an LSE is -inf where a query sees no key), "
            "which JSON cannot carry",
            "false",
        )
    values: list[Any] = flat.tolist()
    return values
