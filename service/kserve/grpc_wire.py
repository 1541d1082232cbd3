"""`ModelInferRequest` and `ModelInferResponse` (tritonclient's generated classes of the Open
Inference Protocol's `grpc_service.proto`) on the wire, around their tensor bytes: a request
walked field by field before protobuf sees it (`split_request`), and a response's
`raw_output_contents` appended to its serialized head (`response_bytes`: no copy through
protobuf's objects).

The walk leaves a request's `raw_input_contents` where they lie, hands protobuf the rest (within
the JSON cap), and counts what protobuf would build beyond that: inputs, outputs, parameters
entries, a shape's dimensions and typed contents' values (against the shape), within a budget of
fields, and refuses a count past its bound (`kserve.heads`) before a Python object is made.

A message of at most `SMALL_HEAD` bytes (a JSON head's bound for the same rule) is parsed by
protobuf first and counted after (`read_request`): its objects are bounded by its size, and the
walk in Python costs fifty times protobuf's parse of a one-token call."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import numpy as np
from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import service_pb2 as pb

from zen_mla import BodyTooLargeError, InvalidInputError, WireFormatError

from .heads import MAX_DIMS, MAX_PARAMETERS, MAX_TENSORS, SMALL_HEAD, check_count, check_shape

__all__ = [
    "MAX_FIELDS",
    "TYPED_FIELD",
    "parse",
    "read_request",
    "response_bytes",
    "split_request",
]

M = TypeVar("M", bound=Message)

_REQUEST = pb.ModelInferRequest.DESCRIPTOR.fields_by_name
_INPUT = pb.ModelInferRequest.InferInputTensor.DESCRIPTOR.fields_by_name
_OUTPUT = pb.ModelInferRequest.InferRequestedOutputTensor.DESCRIPTOR.fields_by_name
RAW_IN = _REQUEST["raw_input_contents"].number
RAW_OUT = pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5
#: fields of a request message at most, its tensors' and contents' fields counted with its
#: own (a request has a handful of inputs, outputs, parameters and raw contents: a walk over
#: millions of tiny fields would hold the loop; a typed contents' values are one field packed,
#: as proto3 writes them, and one field each unpacked)
MAX_FIELDS = 1024
#: a typed contents field by its number: its name and its values' wire type unpacked
_TYPED = {
    f.number: (f.name, {f.TYPE_FLOAT: FIXED32, f.TYPE_DOUBLE: FIXED64}.get(f.type, VARINT))
    for f in pb.InferTensorContents.DESCRIPTOR.fields
    if f.type != f.TYPE_BYTES
}
_BYTES_CONTENTS = pb.InferTensorContents.DESCRIPTOR.fields_by_name["bytes_contents"].number
#: the typed contents field of each datatype that has one (the protocol's; BF16 and FP16 have
#: none and travel raw)
TYPED_FIELD = {"FP32": "fp32_contents", "INT32": "int_contents", "INT64": "int64_contents"}


def parse(kind: type[M], raw: bytes) -> M:
    """`raw` as a `kind` message (WireFormatError where it is none)."""
    try:
        msg: M = kind.FromString(raw)
        return msg
    except DecodeError as exc:
        raise WireFormatError("message", f"a {kind.__name__}", str(exc)[:120]) from None


def _at_most(where: str, bound: int, what: str, count: int, given: str = "more") -> None:
    """InvalidInputError where `count` is past `bound` (`given`: what the refusal says came)."""
    if count > bound:
        raise InvalidInputError(where, f"at most {bound} {what}", given)


def _varint(view: memoryview, at: int) -> tuple[int, int]:
    if at < len(view) and view[at] < 0x80:  # most keys and lengths: one byte
        return view[at], at + 1
    value = shift = 0
    for i in range(at, min(at + 10, len(view))):
        byte = view[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    raise WireFormatError("message", "a protobuf varint", f"a broken one at byte {at}")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _packed_varints(view: memoryview) -> int:
    """Varints in a packed field: its bytes that end one (millions counted at once)."""
    if len(view) <= 256:  # a shape: numpy's call costs more than the count
        return len(view) - len(view.tobytes().translate(None, _ENDS))
    return int(np.count_nonzero(np.frombuffer(view, np.uint8) < 0x80))


_ENDS = bytes(range(0x80))


class _Field(NamedTuple):
    number: int
    wire: int
    start: int  # where its key begins
    at: int  # where its value begins (a length-delimited one's bytes, past the length)
    stop: int


@dataclass(slots=True)
class _Tensor:
    """What a tensor's fields say, counted: its name, and an input's datatype, shape (the dims,
    at most MAX_DIMS), parameters and typed contents' values by field."""

    where: str
    name: bytes = b""
    datatype: str = ""
    dims: list[int] = field(default_factory=list)
    ndims: int = 0
    parameters: int = 0
    contents: bool = False
    values: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Its name where that is a short printable one, else `inputs[i]` or `outputs[i]`."""
        name = self.name.decode("utf-8", "replace")
        return name if name.isprintable() and 0 < len(name) <= 64 else self.where


_IN_NAME, _IN_DATATYPE, _IN_SHAPE, _IN_PARAMETERS, _IN_CONTENTS = (
    _INPUT[n].number for n in ("name", "datatype", "shape", "parameters", "contents")
)
_OUT_NAME, _OUT_PARAMETERS = (_OUTPUT[n].number for n in ("name", "parameters"))
_INPUTS, _OUTPUTS, _PARAMETERS = (_REQUEST[n].number for n in ("inputs", "outputs", "parameters"))


class _Walk:
    """The fields of a request, its tensors' and their contents', counted against one budget
    of MAX_FIELDS."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.fields = 0

    def fields_of(self, at: int, end: int, where: str) -> Iterator[_Field]:
        view = self.view
        while at < end:
            self.fields += 1
            if self.fields > MAX_FIELDS:
                raise WireFormatError(
                    "message",
                    f"at most {MAX_FIELDS} fields (typed contents packed, as proto3 writes them)",
                    "more",
                )
            start = at
            key, at = _varint(view, at)
            number, wire = key >> 3, key & 7
            if wire == LENGTH_DELIMITED:
                length, at = _varint(view, at)
                stop = at + length
            elif wire == VARINT:
                _, stop = _varint(view, at)
            elif wire == FIXED64:
                stop = at + 8
            elif wire == FIXED32:
                stop = at + 4
            else:
                raise WireFormatError(where, "protobuf wire types 0, 1, 2 or 5", str(wire))
            if number == 0 or stop > end:
                raise WireFormatError(where, "fields within its bytes", f"field {number} past them")
            yield _Field(number, wire, start, at, stop)
            at = stop

    @staticmethod
    def length_delimited(f: _Field, where: str) -> None:
        if f.wire != LENGTH_DELIMITED:
            raise WireFormatError(where, "wire type 2 (length-delimited)", str(f.wire))

    def input(self, f: _Field, where: str) -> _Tensor:
        """An InferInputTensor, counted."""
        self.length_delimited(f, where)
        t = _Tensor(where)
        for g in self.fields_of(f.at, f.stop, where):
            number = g.number
            if number == _IN_SHAPE:
                self.shape(t, g)
            elif number == _IN_NAME:
                self.length_delimited(g, f"{where}.name")
                t.name = self.view[g.at : g.stop].tobytes()
            elif number == _IN_DATATYPE:
                self.length_delimited(g, f"{t.label}.datatype")
                t.datatype = self.view[g.at : g.stop].tobytes().decode("utf-8", "replace")
            elif number == _IN_PARAMETERS:
                self.parameter(t, g)
            elif number == _IN_CONTENTS:
                self.length_delimited(g, f"{t.label}.contents")
                t.contents = True
                self.contents(t, g)
        return t

    def output(self, f: _Field, where: str) -> None:
        """An InferRequestedOutputTensor, counted."""
        self.length_delimited(f, where)
        t = _Tensor(where)
        for g in self.fields_of(f.at, f.stop, where):
            if g.number == _OUT_NAME:
                self.length_delimited(g, f"{where}.name")
                t.name = self.view[g.at : g.stop].tobytes()
            elif g.number == _OUT_PARAMETERS:
                self.parameter(t, g)

    def parameter(self, t: _Tensor, g: _Field) -> None:
        """One entry of a tensor's parameters map."""
        self.length_delimited(g, f"{t.label}.parameters")
        t.parameters += 1
        _at_most(f"{t.label}.parameters", MAX_PARAMETERS, "entries", t.parameters)

    def shape(self, t: _Tensor, g: _Field) -> None:
        """Dims packed (counted at once) or one a field; decoded while at most MAX_DIMS."""
        if g.wire == LENGTH_DELIMITED:
            count = _packed_varints(self.view[g.at : g.stop])
        elif g.wire == VARINT:
            count = 1
        else:
            raise WireFormatError(f"{t.label}.shape", "wire type 0 or 2", str(g.wire))
        t.ndims += count
        _at_most(f"{t.label}.shape", MAX_DIMS, "dimensions", t.ndims, str(t.ndims))
        at = g.at
        for _ in range(count):
            value, at = _varint(self.view, at)
            t.dims.append(value - (1 << 64) if value >> 63 else value)  # int64

    def contents(self, t: _Tensor, g: _Field) -> None:
        """InferTensorContents: each typed field's values, packed or one a field."""
        where = f"{t.label}.contents"
        for h in self.fields_of(g.at, g.stop, where):
            if h.number == _BYTES_CONTENTS:
                name, count = "bytes_contents", 1
            elif h.number in _TYPED:
                name, unpacked = _TYPED[h.number]
                if h.wire == unpacked:
                    count = 1
                elif h.wire != LENGTH_DELIMITED:
                    raise WireFormatError(
                        f"{where}.{name}", f"wire type {unpacked} or 2", str(h.wire)
                    )
                elif unpacked == VARINT:
                    count = _packed_varints(self.view[h.at : h.stop])
                else:
                    count = (h.stop - h.at) // (4 if unpacked == FIXED32 else 8)
            else:
                continue
            t.values[name] = t.values.get(name, 0) + count


def _check_input(t: _Tensor) -> None:
    """An input's typed contents: its datatype's field alone (BF16 and FP16 have none), as
    many values as its shape holds."""
    if not t.contents:
        return
    where = f"{t.label}.contents"
    given = ", ".join(sorted(t.values)) or "an empty contents"
    typed = TYPED_FIELD.get(t.datatype)
    if typed is None:
        if t.datatype in ("BF16", "FP16"):
            raise InvalidInputError(
                where,
                f"{t.datatype} as raw bytes (raw_input_contents, or system shared memory): "
                f"{t.datatype} has no typed contents field",
                given,
            )
        typed_ones = ", ".join(f"{d}: {n}" for d, n in TYPED_FIELD.items())
        raise InvalidInputError(where, f"a datatype with typed contents ({typed_ones})", given)
    if set(t.values) - {typed}:
        raise InvalidInputError(where, f"{t.datatype} values in {typed} alone", given)
    check_count(where, t.datatype, check_shape(t.label, t.dims), t.values.get(typed, 0))


def split_request(raw: bytes, max_head: int) -> tuple[bytes, list[memoryview]]:
    """`raw`, a ModelInferRequest, as its fields but the raw contents (a message of its own,
    at most `max_head` bytes: BodyTooLargeError above) and its raw contents in order (views of
    `raw`). WireFormatError where `raw` is no protobuf message; InvalidInputError, naming the
    field, where a count is past its bound (`kserve.heads`) or an input's typed contents are
    not its datatype's or not as many as its shape."""
    view = memoryview(raw)
    walk = _Walk(view)
    head: list[memoryview] = []
    raws: list[memoryview] = []
    size = inputs = outputs = parameters = 0
    for f in walk.fields_of(0, len(view), "message"):
        if f.number == RAW_IN and f.wire == LENGTH_DELIMITED:
            raws.append(view[f.at : f.stop])
            continue
        head.append(view[f.start : f.stop])
        size += f.stop - f.start
        if f.number == _INPUTS:
            inputs += 1
            _at_most("inputs", MAX_TENSORS, "tensors", inputs)
            _check_input(walk.input(f, f"inputs[{inputs - 1}]"))
        elif f.number == _OUTPUTS:
            outputs += 1
            _at_most("outputs", MAX_TENSORS, "tensors", outputs)
            walk.output(f, f"outputs[{outputs - 1}]")
        elif f.number == _PARAMETERS:
            walk.length_delimited(f, "parameters")
            parameters += 1
            _at_most("parameters", MAX_PARAMETERS, "entries", parameters)
    if size > max_head:
        raise BodyTooLargeError(
            f"request message: expected at most {max_head} bytes besides raw_input_contents, got "
            f"{size}; send tensors as raw_input_contents"
        )
    return b"".join(head), raws


def _count_parsed(msg: pb.ModelInferRequest) -> None:
    """What `split_request`'s walk counts, counted on a parsed message: the same bounds, the
    same refusals."""
    _at_most("inputs", MAX_TENSORS, "tensors", len(msg.inputs))
    _at_most("outputs", MAX_TENSORS, "tensors", len(msg.outputs))
    _at_most("parameters", MAX_PARAMETERS, "entries", len(msg.parameters))
    for i, tensor in enumerate(msg.inputs):
        contents = tensor.HasField("contents")
        within = len(tensor.shape) <= MAX_DIMS and len(tensor.parameters) <= MAX_PARAMETERS
        if within and not contents:
            continue  # the common case: nothing more to count, no object made
        t = _Tensor(f"inputs[{i}]", tensor.name.encode(), tensor.datatype, contents=contents)
        t.ndims = len(tensor.shape)
        _at_most(f"{t.label}.shape", MAX_DIMS, "dimensions", t.ndims, str(t.ndims))
        _at_most(f"{t.label}.parameters", MAX_PARAMETERS, "entries", len(tensor.parameters))
        t.dims = list(tensor.shape)
        t.values = {f.name: len(v) for f, v in tensor.contents.ListFields()}
        _check_input(t)
    for i, out in enumerate(msg.outputs):
        if len(out.parameters) > MAX_PARAMETERS:
            label = _Tensor(f"outputs[{i}]", out.name.encode()).label
            _at_most(f"{label}.parameters", MAX_PARAMETERS, "entries", len(out.parameters))


def read_request(
    raw: bytes, max_head: int
) -> tuple[pb.ModelInferRequest | bytes, list[memoryview]]:
    """`raw`, a ModelInferRequest, as its head and its raw contents in order, with the refusals
    of `split_request`. A message of at most `SMALL_HEAD` bytes (and `max_head`) is parsed
    first and counted after: its head comes parsed. A larger one is walked first: its head
    comes as bytes, for the caller to `parse` (in a thread where it is large)."""
    if len(raw) > min(SMALL_HEAD, max_head):
        return split_request(raw, max_head)
    msg = parse(pb.ModelInferRequest, raw)
    _count_parsed(msg)
    raws = [memoryview(r) for r in msg.raw_input_contents]
    msg.ClearField("raw_input_contents")
    return msg, raws


def response_bytes(head: bytes, raws: Sequence[bytes | memoryview]) -> bytes:
    """A ModelInferResponse: `head` (serialized, without raw contents), then `raws` as its
    raw_output_contents, in order."""
    key = _encode_varint(RAW_OUT << 3 | LENGTH_DELIMITED)
    parts: list[bytes | memoryview] = [head]
    for data in raws:
        parts += [key, _encode_varint(memoryview(data).nbytes), data]
    return b"".join(parts)
