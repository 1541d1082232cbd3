"""`ModelInfer` and `SystemSharedMemoryRegister` over gRPC, as forms of the one pipeline
(`pipeline.serve`, entered by a `doors.GrpcDoor`): the same gate, token, admission, shares,
deadline, queue, metrics and log line as their HTTP twins (`kserve.infer`, `kserve.register`).

An infer request's message is split around its raw tensor bytes (`grpc_wire`); the rest is read
as the HTTP form's JSON would be (`kserve.request`: every rule, every message naming the tensor),
and the raw bytes are copied once into the pool's shared memory, where the workers read them in
place. Inputs may also be typed `contents` or lie in system shared memory; outputs go back as
`raw_output_contents` (bf16 has no typed field) or into system shared memory."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tritonclient.grpc import service_pb2 as pb

from zen_mla import InvalidInputError, ZenMLAError
from zen_mla.engine import PrefillEngine, SharedBuffer
from zen_mla.regions import off_error
from zen_mla.wire import tensor_bytes
from zen_mla.wire.dtypes import BY_TORCH

from ..answer import answer_metadata
from ..body import SMALL_BYTES
from ..doors import COPIES, Door
from ..forms.base import Computed, Expect, Form, RequestRecord, Work
from ..settings import Settings
from ..state import ServiceState
from . import request as kr
from .grpc_errors import GrpcError, grpc_error
from .grpc_wire import parse, read_request, response_bytes
from .infer import V2Form, from_json, input_tensors, place_inputs
from .outputs import Places, write_to_region
from .register import REGISTER_BYTES, regions_of, registry_of

__all__ = [
    "GRPC_MAX_MESSAGE",
    "GrpcAnswer",
    "GrpcInferForm",
    "GrpcRegisterForm",
    "GrpcReply",
    "message_limit",
]

#: the largest message gRPC's transport takes (its limit is a signed 32-bit count)
GRPC_MAX_MESSAGE = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class GrpcReply:
    """A response message, and what gives its bytes back (and their charge) once its call
    has ended (`grpc_server._send`)."""

    message: bytes
    release: Callable[[], None] = lambda: None


#: a call's answer: its response, an error status, or None (the caller is gone)
GrpcAnswer = GrpcReply | GrpcError | None
_CONTENTS = tuple(f.name for f in pb.InferTensorContents.DESCRIPTOR.fields)


def message_limit(settings: Settings) -> int:
    """The most bytes grpc's transport reads of any method's message: `grpc_max_message_bytes`,
    within the body limit, and small enough that a call charged `COPIES` times it fits the
    budget."""
    return min(
        settings.grpc_max_message_bytes,
        settings.max_body_bytes,
        settings.max_inflight_bytes // COPIES,
        GRPC_MAX_MESSAGE,
    )


def _value(name: str, p: pb.InferParameter) -> Any:
    kind = p.WhichOneof("parameter_choice")
    if kind is None:
        raise InvalidInputError(name, "a parameter with a value", "none")
    return getattr(p, kind)


def _parameters(name: str, params: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    return {key: _value(f"{name}.{key}", p) for key, p in params.items()}


def _contents(name: str, tensor: pb.ModelInferRequest.InferInputTensor) -> list[Any]:
    given = [f for f in _CONTENTS if len(getattr(tensor.contents, f))]
    if len(given) > 1:
        raise InvalidInputError(f"{name}.contents", "one typed field", " and ".join(given))
    return list(getattr(tensor.contents, given[0])) if given else []


def request_doc(msg: pb.ModelInferRequest, raws: int) -> tuple[dict[str, Any], list[str]]:
    """The request as the HTTP form's JSON would give it (`kserve.request.parse_request` reads
    it), and the inputs whose bytes are raw contents, in their order (`raws` of them given)."""
    inputs: list[dict[str, Any]] = []
    raw_names: list[str] = []
    for tensor in msg.inputs:
        name = tensor.name
        params = _parameters(f"{name}.parameters", tensor.parameters)
        if "binary_data_size" in params:
            raise InvalidInputError(
                f"{name}.parameters", "no binary_data_size over gRPC (raw_input_contents)", "one"
            )
        entry: dict[str, Any] = {
            "name": name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
            "parameters": params,
        }
        if tensor.HasField("contents"):
            entry["data"] = _contents(name, tensor)
        elif not any(k.startswith("shared_memory_") for k in params):
            raw_names.append(name)
            params["binary_data_size"] = 0  # the raw entry's size, set by the caller
        inputs.append(entry)
    if len(raw_names) != raws:
        raise InvalidInputError(
            "raw_input_contents",
            f"{len(raw_names)} entries, one for each input given neither contents nor shared "
            f"memory ({', '.join(raw_names) or 'none'})",
            str(raws),
        )
    outputs = [
        {"name": o.name, "parameters": _parameters(f"{o.name}.parameters", o.parameters)}
        for o in msg.outputs
    ]
    params = _parameters("parameters", msg.parameters)
    params.setdefault("binary_data_output", True)  # outputs not asked for: raw contents
    doc: dict[str, Any] = {"inputs": inputs, "parameters": params}
    if msg.id:
        doc["id"] = msg.id
    if outputs:
        doc["outputs"] = outputs
    return doc, raw_names


class GrpcInferForm(V2Form[GrpcAnswer]):
    """`ModelInfer`: a ModelInferRequest, inputs as raw contents, typed contents or in system
    shared memory; the answer a ModelInferResponse with the outputs as raw contents (in their
    requested order; an empty entry for one written to shared memory, so that the indices hold)."""

    route = "grpc"

    def expect(self, settings: Settings, door: Door) -> Expect:
        self.max_json_bytes = settings.max_json_bytes
        self.system_shm = settings.system_shm
        self.scope(door)
        return Expect(message_limit(settings), small=True)

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> Work:
        assert isinstance(body, bytes)
        head, raws = read_request(body, self.max_json_bytes)
        if isinstance(head, bytes) and len(head) > SMALL_BYTES:
            async with self.big_json:
                req, tensors = await asyncio.to_thread(self._read, head, raws)
        else:
            req, tensors = self._read(head, raws)
        self.req = req
        record.request_id = req.id
        if req.uses_shm and not self.system_shm:
            raise off_error()
        buf = None
        if raws:
            buf = engine.buffer(sum(r.nbytes for r in raws))
            if buf.nbytes > SMALL_BYTES:
                await asyncio.to_thread(_copy_in, buf, raws)
            else:
                _copy_in(buf, raws)
        del body, raws
        try:
            tensors |= input_tensors(engine, req, buf, 0, self.regions)
            homes, staging = place_inputs(engine, tensors, buf, req, self.regions)
            weight, leases = self.lease_weight(tensors, req)
        except BaseException:
            if buf is not None:
                engine.release(buf)
            raise
        made = [b for b in (buf, staging) if b is not None]
        return Work(tensors, req.options, [*homes, *weight], made, req.timeout, leases)

    def _read(
        self, head: pb.ModelInferRequest | bytes, raws: list[memoryview]
    ) -> tuple[kr.InferRequest, dict[str, torch.Tensor]]:
        msg = head if isinstance(head, pb.ModelInferRequest) else parse(pb.ModelInferRequest, head)
        kr.check_model(msg.model_name, msg.model_version)
        doc, raw_names = request_doc(msg, len(raws))
        sizes = dict(zip(raw_names, (r.nbytes for r in raws), strict=True))
        for entry in doc["inputs"]:
            if entry["name"] in sizes:
                entry["parameters"]["binary_data_size"] = sizes[entry["name"]]
        try:
            req = kr.parse_request(doc, sum(sizes.values()))
        except InvalidInputError as exc:
            if not exc.name.endswith(".binary_data_size"):
                raise
            name = exc.name.removesuffix(".binary_data_size")
            raise InvalidInputError(
                f"raw_input_contents[{raw_names.index(name)}] ({name})", exc.expected, exc.got
            ) from None
        loaded = {n: from_json(i) for n, i in req.inputs.items() if i.data is not None}
        return req, loaded

    async def answer(self, result: Computed | None, record: RequestRecord) -> GrpcAnswer:
        assert result is not None and self.req is not None
        try:
            response = await _respond(self.req, result, self.out_places, self.direct)
        except BaseException:
            result.release()
            raise
        record.bytes_out = len(response)
        # the answer's charge is the result's: kept until the response is written
        return GrpcReply(response, result.release)

    def refuse(
        self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]
    ) -> GrpcAnswer:
        return grpc_error(exc)

    def hung_up(self) -> GrpcAnswer:
        return None


def _copy_in(buf: SharedBuffer, raws: list[memoryview]) -> None:
    """The raw contents, one after another, into `buf` (numpy copies without the GIL)."""
    dst = np.frombuffer(buf.bytes_view, np.uint8)
    at = 0
    for raw in raws:
        np.copyto(dst[at : at + raw.nbytes], np.frombuffer(raw, np.uint8))
        at += raw.nbytes


async def _respond(req: kr.InferRequest, result: Computed, places: Places, written: bool) -> bytes:
    """The ModelInferResponse: each output's entry, its bytes raw or written into its region
    (by pwrite unless the workers wrote them there)."""
    response = pb.ModelInferResponse(model_name=kr.MODEL, model_version=kr.VERSION, id=req.id or "")
    for key, value in answer_metadata(result.kernels).items():
        response.parameters[key].string_param = value
    tensors = {"out": result.out, "lse": result.lse}
    raws: list[bytes | memoryview] = []
    for out in req.outputs:
        t = tensors[out.name]
        assert t is not None
        entry = response.outputs.add(
            name=out.name, datatype=BY_TORCH[t.dtype].kserve, shape=list(t.shape)
        )
        place = places[out.name]
        if place is None:
            raws.append(tensor_bytes(t))
            continue
        assert out.shm is not None
        if not written:
            await write_to_region(place[0], out.shm.offset, t)
        entry.parameters["shared_memory_region"].string_param = out.shm.region
        entry.parameters["shared_memory_offset"].int64_param = out.shm.offset
        entry.parameters["shared_memory_byte_size"].int64_param = t.nbytes
        raws.append(b"")
    head = response.SerializeToString()
    size = sum(memoryview(r).nbytes for r in raws)
    if size > SMALL_BYTES:
        return await asyncio.to_thread(response_bytes, head, raws)
    return response_bytes(head, raws)


class GrpcRegisterForm(Form[GrpcAnswer]):
    """`SystemSharedMemoryRegister`: a small message read as any is, a /dev/shm object
    registered as the caller's region, nothing computed."""

    route = "grpc_register"
    computes = False

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.door: Door | None = None

    def expect(self, settings: Settings, door: Door) -> Expect:
        registry_of(self.state)
        self.door = door
        return Expect(REGISTER_BYTES, small=True)

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> None:
        assert isinstance(body, bytes) and self.door is not None
        msg = parse(pb.SystemSharedMemoryRegisterRequest, body)
        regions_of(self.state, self.door).register(msg.name, msg.key, msg.offset, msg.byte_size)
        return None

    async def answer(self, result: Computed | None, record: RequestRecord) -> GrpcAnswer:
        return GrpcReply(pb.SystemSharedMemoryRegisterResponse().SerializeToString())

    def refuse(
        self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]
    ) -> GrpcAnswer:
        return grpc_error(exc)

    def hung_up(self) -> GrpcAnswer:
        return None
