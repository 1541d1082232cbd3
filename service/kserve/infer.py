"""`POST /v2/models/mla_prefill/infer`, and where its inputs lie.

An infer request (`InferForm`) goes through the one pipeline as a `/prefill` does
(`pipeline.serve`): the same gate, token, admission, body limits and rate, deadline, queue and
metrics. Its body is read into the pool's shared
memory shifted so that the binary tensor data after the JSON starts cache-line aligned; q, k
and v there are read in place by the workers. Inputs may also be JSON numbers or lie in system
shared memory (`system_shm`); where the outputs go is `kserve.outputs`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
from fastapi import Request
from fastapi.responses import Response

from zen_mla import (
    BodyTooLargeError,
    InvalidInputError,
    UnsupportedMediaTypeError,
    WireFormatError,
    ZenMLAError,
)
from zen_mla.caller import Caller
from zen_mla.engine import OutputPlaces, PrefillEngine, PrefillRequest, SharedBuffer
from zen_mla.regions import CallerShm, off_error

from ..answer import server_timing
from ..body import SMALL_BYTES
from ..doors import Door, byte_count
from ..forms.base import Computed, Expect, Form, RequestRecord, Work
from ..forms.weight import lend_weight
from ..settings import Settings
from ..state import ServiceState
from . import request as kr
from .errors import error_response
from .outputs import Places, direct_outputs, output_places, respond

__all__ = [
    "ALIGN",
    "InferForm",
    "V2Form",
    "check_regions",
    "from_json",
    "input_tensors",
    "place_inputs",
]

ALIGN = 64  # the binary tensor data starts on a cache line
A = TypeVar("A")
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


class V2Form(Form[A]):
    """What an infer request's forms share, over HTTP (`InferForm`) and gRPC
    (`grpc_infer.GrpcInferForm`): the request read (`req`), the caller's regions (`regions`,
    once `expect` knows the caller: it names its own only), where its outputs go, and a
    worker's failure explained by the regions it read."""

    def __init__(self, state: ServiceState, big_json: asyncio.Semaphore) -> None:
        self.state = state
        self.registry = state.system_shm
        self.regions: CallerShm | None = None
        self.caller: Caller | None = None
        self.big_json = big_json
        self.req: kr.InferRequest | None = None
        self.out_places: Places = {}
        self.direct = False
        self.max_json_bytes = 0  # the rest from the request's head (`expect`)
        self.system_shm = False

    def scope(self, door: Door) -> None:
        """The regions and weights this request may name: its caller's (`door` authorized
        already)."""
        self.caller = door.caller
        if self.registry is not None:
            self.regions = self.registry.of(door.caller)

    def lease_weight(
        self, tensors: dict[str, torch.Tensor], req: kr.InferRequest
    ) -> tuple[list[SharedBuffer], tuple[Callable[[], None], ...]]:
        """Over the latent cache: the weight `req` names, leased for the work and added to
        `tensors` as `w_kv_b`; the buffer it lies in and the lease (none otherwise)."""
        if req.weight is None:
            return [], ()
        weight, lease = lend_weight(
            self.state, self.caller, req.weight, "parameters.weight", tensors
        )
        return [weight], (lease,)

    def places(self, prepared: PrefillRequest) -> OutputPlaces | None:
        assert self.req is not None
        self.out_places = output_places(self.req, prepared, self.regions, self.max_json_bytes)
        direct = direct_outputs(self.req, self.out_places)
        self.direct = direct is not None
        return direct

    def explain(self, exc: ZenMLAError) -> None:
        if self.req is not None:
            check_regions(self.req, self.regions)  # a worker failed on a region shrunk meanwhile


class InferForm(V2Form[Response]):
    """`POST /v2/models/{model}[/versions/{version}]/infer`: an inference request (JSON, then
    binary tensor data), inputs in the body, as JSON numbers or in system shared memory; the
    answer in the protocol's form, outputs where the request asked."""

    route = "v2"

    def __init__(
        self,
        request: Request,
        model: str,
        version: str,
        state: ServiceState,
        big_json: asyncio.Semaphore,
    ) -> None:
        super().__init__(state, big_json)
        self.request = request
        self.model, self.version = model, version
        self.json_bytes = self.binary_bytes = 0

    def expect(self, settings: Settings, door: Door) -> Expect:
        kr.check_model(self.model, self.version)
        self.max_json_bytes = settings.max_json_bytes
        headers = self.request.headers
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise UnsupportedMediaTypeError(
                f"Content-Encoding: expected identity (bodies are read as sent), got {encoding}"
            )
        n = door.body_size(settings.max_body_bytes)
        self.json_bytes = _header_length(self.request, n)
        self.binary_bytes = n - self.json_bytes
        if self.json_bytes > settings.max_json_bytes:
            raise BodyTooLargeError(
                f"inference header: expected at most {settings.max_json_bytes} bytes of JSON, "
                f"got {self.json_bytes}; send tensors as binary data (binary_data_size)"
            )
        self.system_shm = settings.system_shm
        self.scope(door)
        return Expect(settings.max_body_bytes, lead=-self.json_bytes % ALIGN)

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> Work:
        assert isinstance(body, SharedBuffer)
        lead = -self.json_bytes % ALIGN
        raw = bytes(body.bytes_view[lead : lead + self.json_bytes])
        req, tensors = await _read_request(raw, self.binary_bytes, self.big_json)
        del raw
        self.req = req
        record.request_id = req.id
        if req.uses_shm and not self.system_shm:
            raise off_error()
        tensors |= input_tensors(engine, req, body, lead + self.json_bytes, self.regions)
        homes, staging = place_inputs(engine, tensors, body, req, self.regions)
        weight, leases = self.lease_weight(tensors, req)
        # staging, where made, is given back with the body once the work is done
        return Work(tensors, req.options, [*homes, *weight], staging, req.timeout, leases)

    async def answer(self, result: Computed | None, record: RequestRecord) -> Response:
        assert result is not None and self.req is not None
        response = await respond(self.req, result, self.out_places, self.direct)
        record.bytes_out = int(response.headers.get("content-length", 0))
        return server_timing(response, record)

    def refuse(self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]) -> Response:
        return error_response(exc, headers)

    def hung_up(self) -> Response:
        return Response(status_code=499)


async def _read_request(
    raw: bytes, binary_bytes: int, big_json: asyncio.Semaphore
) -> tuple[kr.InferRequest, dict[str, torch.Tensor]]:
    """The request, and its inputs given as JSON data as tensors (the request keeps no JSON
    numbers: they are dropped once converted)."""

    def read() -> tuple[kr.InferRequest, dict[str, torch.Tensor]]:
        req = kr.parse_request(kr.parse_header(raw), binary_bytes)
        loaded = {n: from_json(i) for n, i in req.inputs.items() if i.data is not None}
        for name in loaded:
            req.inputs[name] = dataclasses.replace(req.inputs[name], data=None)
        return req, loaded

    if len(raw) <= SMALL_BYTES:
        return read()
    async with big_json:
        return await asyncio.to_thread(read)


def input_tensors(
    engine: PrefillEngine,
    req: kr.InferRequest,
    buf: SharedBuffer | None,
    data_at: int,
    regions: CallerShm | None,
) -> dict[str, torch.Tensor]:
    """Each input given as binary data or in a region as a tensor: views of the body's buffer
    or of the region (read by the workers only), copies where they must be (misaligned, or
    cu_seq_lens from a region, read here)."""
    tensors = {}
    for name, spec in req.inputs.items():
        if spec.binary is not None:
            assert buf is not None, "binary data lies in a buffer"
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


def check_regions(req: kr.InferRequest, regions: CallerShm | None) -> None:
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


def from_json(spec: kr.InputSpec) -> torch.Tensor:
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


def place_inputs(
    engine: PrefillEngine,
    tensors: dict[str, torch.Tensor],
    body: SharedBuffer | None,
    req: kr.InferRequest,
    regions: CallerShm | None,
) -> tuple[list[SharedBuffer], SharedBuffer | None]:
    """The buffers q, k and v (or q, kv_c and k_pe) lie in (`body`: the one the request's
    binary data was read into, if any); where some lie in a region and others in none (JSON
    data, copies), those others are staged into a buffer of ours first (returned second, for
    the caller to release): the pool would stage all three, reading the region here."""
    given = [] if body is None else [body]
    values = ("q", "kv_c", "k_pe") if "kv_c" in tensors else ("q", "k", "v")
    for name in values:
        place = req.inputs[name].shm
        if place is not None and regions is not None:
            given.append(regions.resolve(name, place.region).buffer)
    loose = [n for n in values if not any(b.contains(tensors[n]) for b in given)]
    if not loose or all(b is body for b in given):
        return given, None  # all in place, or the pool stages them from ordinary memory
    sizes = [-(-tensors[n].nbytes // ALIGN) * ALIGN for n in loose]
    staging = engine.buffer(sum(sizes))
    at = 0
    for name, size in zip(loose, sizes, strict=True):
        t = tensors[name]
        tensors[name] = staging.tensor(at, tuple(t.shape), t.dtype).copy_(t)
        at += size
    return [*given, staging], staging
