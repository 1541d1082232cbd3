"""`ModelInferRequest` and `ModelInferResponse` (tritonclient's generated classes of the Open
Inference Protocol's `grpc_service.proto`) on the wire, around their tensor bytes: a request's
`raw_input_contents` found by walking its top-level fields and left where they lie
(`split_request`: protobuf parses the rest alone, within the JSON cap, so no field count or
nesting can make it allocate more than that), and a response's `raw_output_contents` appended
to its serialized head (`response_bytes`: no copy through protobuf's objects)."""

from __future__ import annotations

from collections.abc import Sequence

from tritonclient.grpc import service_pb2 as pb

from zen_mla import BodyTooLargeError, WireFormatError

__all__ = ["MAX_FIELDS", "response_bytes", "split_request"]

RAW_IN = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
RAW_OUT = pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
LENGTH_DELIMITED = 2
#: top-level fields of a request message at most (a request has a handful of inputs, outputs,
#: parameters and raw contents: a walk over millions of tiny fields would hold the loop)
MAX_FIELDS = 1024


def _varint(view: memoryview, at: int) -> tuple[int, int]:
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


def split_request(raw: bytes, max_head: int) -> tuple[bytes, list[memoryview]]:
    """`raw`, a ModelInferRequest, as its fields but the raw contents (a message of its own,
    at most `max_head` bytes: BodyTooLargeError above) and its raw contents in order (views of
    `raw`). WireFormatError where `raw` is no protobuf message."""
    view = memoryview(raw)
    head: list[memoryview] = []
    raws: list[memoryview] = []
    size = fields = at = 0
    end = len(view)
    while at < end:
        fields += 1
        if fields > MAX_FIELDS:
            raise WireFormatError("message", f"at most {MAX_FIELDS} top-level fields", "more")
        start = at
        key, at = _varint(view, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, stop = _varint(view, at)
        elif wire == 1:
            stop = at + 8
        elif wire == LENGTH_DELIMITED:
            length, at = _varint(view, at)
            stop = at + length
        elif wire == 5:
            stop = at + 4
        else:
            raise WireFormatError("message", "protobuf wire types 0, 1, 2 or 5", str(wire))
        if number == 0 or stop > end:
            raise WireFormatError("message", "fields within its bytes", f"field {number} past them")
        if number == RAW_IN and wire == LENGTH_DELIMITED:
            raws.append(view[at:stop])
        else:
            head.append(view[start:stop])
            size += stop - start
        at = stop
    if size > max_head:
        raise BodyTooLargeError(
            f"request message: expected at most {max_head} bytes besides raw_input_contents, got "
            f"{size}; send tensors as raw_input_contents"
        )
    return b"".join(head), raws


def response_bytes(head: bytes, raws: Sequence[bytes | memoryview]) -> bytes:
    """A ModelInferResponse: `head` (serialized, without raw contents), then `raws` as its
    raw_output_contents, in order."""
    key = _encode_varint(RAW_OUT << 3 | LENGTH_DELIMITED)
    parts: list[bytes | memoryview] = [head]
    for data in raws:
        parts += [key, _encode_varint(memoryview(data).nbytes), data]
    return b"".join(parts)
