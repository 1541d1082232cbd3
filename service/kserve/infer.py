"""`POST /v2/models/mla_prefill/infer`, and where its inputs lie.

An infer request goes the way a `/prefill` does (`exchange`): the same gate, token, admission,
body limits and rate, deadline, queue and metrics. Its body is read into the pool's shared
memory shifted so that the binary tensor data after the JSON starts cache-line aligned; q, k
and v there are read in place by the workers. Inputs may also be JSON numbers or lie in system
shared memory (`system_shm`); where the outputs go is `kserve.outputs`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import time

import numpy as np
import torch
from fastapi import Request
from fastapi.responses import Response

from zen_mla import (
    BodyTooLargeError,
    InvalidInputError,
    KernelError,
    UnsupportedMediaTypeError,
    WireFormatError,
)
from zen_mla.engine import PrefillEngine
from zen_mla.pool import SharedBuffer

from ..body import SMALL_BYTES
from ..exchange import (
    Exchange,
    admit,
    byte_count,
    compute,
    content_length,
    disconnected,
    drop_body,
    gate,
    receive,
    timed,
)
from ..state import ServiceState
from . import request as kr
from .outputs import direct_outputs, output_places, respond
from .system_shm import SystemShmRegistry, off_error

__all__ = ["ALIGN", "serve_infer"]

ALIGN = 64  # the binary tensor data starts on a cache line
HEADER_LENGTH = "inference-header-content-length"


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


async def serve_infer(
    state: ServiceState,
    big_json: asyncio.Semaphore,
    request: Request,
    model: str,
    version: str,
    x: Exchange,
) -> Response:
    kr.check_model(model, version)
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
        raise off_error()
    tensors |= _inputs(engine, req, buf, lead + json_bytes, state.system_shm)
    homes, staging = _place_inputs(engine, tensors, buf, req, state.system_shm)
    if staging is not None:
        x.staging.append(staging)  # given back with the body, once the work is done
    prepared = engine.prepare(tensors, req.options)
    places = output_places(req, prepared, state.system_shm, s.max_json_bytes)
    direct = direct_outputs(req, places)
    run = functools.partial(engine.run, prepared, inputs=homes, outputs=direct)
    try:
        result, timing = await compute(state, disconnected(request), prepared, run, x)
    except KernelError:
        _check_regions(req, state.system_shm)  # a worker failed on a region shrunk meanwhile
        raise
    await drop_body(engine, x)
    response = await respond(req, result, places, direct is not None)
    x.status = 200
    x.bytes_out = int(response.headers.get("content-length", 0))
    return timed(response, ingest_s, *timing, x)


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
            region = regions.place(name, spec.shm.region, spec.shm.offset, spec.nbytes, spec.dtype)
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
