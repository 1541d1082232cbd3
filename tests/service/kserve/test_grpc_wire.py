"""gRPC's pieces that need no server: a ModelInferRequest split around its raw contents as
protobuf would read it, every malformed message and every count past its bound (nested ones
too) refused before protobuf sees it, typed contents held to their datatype and shape, the same
counts and refusals where a small message is parsed first (`read_request`), a response with
raw contents appended as protobuf writes it, errors as statuses from the one table, and a
peer's address."""

from __future__ import annotations

import struct
import tracemalloc

import grpc
import pytest
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

import zen_mla
from service.doors import peer_host
from service.kserve.grpc_errors import grpc_error
from service.kserve.grpc_wire import (
    MAX_FIELDS,
    TYPED_FIELD,
    read_request,
    response_bytes,
    split_request,
)
from service.kserve.heads import MAX_DIMS, MAX_PARAMETERS, MAX_TENSORS, SMALL_HEAD
from tests.service.protobuf_bytes import field, key, varint
from zen_mla.errors import BodyTooLargeError, WireFormatError


def _request(raws: list[bytes]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="mla_prefill", id="r1")
    request.parameters["causal"].bool_param = True
    for i, raw in enumerate(raws):
        request.inputs.add(name=f"t{i}", datatype="BF16", shape=[len(raw) // 2])
        request.raw_input_contents.append(raw)
    return request


def test_the_split_is_what_protobuf_reads():
    raws = [b"\x01" * 300, b"", b"\x02\x03" * 70_000]
    request = _request(raws)
    head, got = split_request(request.SerializeToString(), 1 << 20)
    assert [bytes(r) for r in got] == raws
    parsed = pb.ModelInferRequest.FromString(head)
    request.ClearField("raw_input_contents")
    assert parsed == request


def _parsed_first(raw: bytes, max_head: int) -> tuple[bytes, list[memoryview]]:
    """`read_request` on a message small enough to be parsed first, its head serialized."""
    assert len(raw) <= SMALL_HEAD
    head, raws = read_request(raw, max_head)
    assert isinstance(head, pb.ModelInferRequest)
    return head.SerializeToString(), raws


#: the two ways a request's head is counted: walked first, parsed first
READS = pytest.mark.parametrize("read", [split_request, _parsed_first], ids=["walked", "parsed"])


@pytest.mark.parametrize("size", [300, SMALL_HEAD])
def test_a_small_message_is_parsed_first_a_large_one_walked(size):
    request = _request([b"\x05" * size])
    raw = request.SerializeToString()
    head, raws = read_request(raw, 1 << 20)
    assert [bytes(r) for r in raws] == [b"\x05" * size]
    request.ClearField("raw_input_contents")
    if len(raw) <= SMALL_HEAD:
        assert head == request
    else:
        assert isinstance(head, bytes) and pb.ModelInferRequest.FromString(head) == request
    assert isinstance(read_request(raw, len(raw) - 1)[0], bytes)  # the head cap is the walk's


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"\x0a\xff\xff\xff\xff\x0f", "past them"),  # a length past the end
        (b"\x0a" + b"\xff" * 11, "broken"),  # a varint of 11 bytes
        (b"\x0b", "wire types"),  # start group
        (b"\x02\x00", "past them"),  # field number 0
        (b"\x18\x01" * (MAX_FIELDS + 1), f"at most {MAX_FIELDS}"),
    ],
    ids=["past_the_end", "long_varint", "group", "field_zero", "too_many_fields"],
)
def test_malformed_messages_are_refused_before_protobuf(raw, fragment):
    with pytest.raises(WireFormatError, match=fragment):
        split_request(raw, 1 << 20)


def test_a_head_over_the_cap_is_refused_and_raw_contents_do_not_count():
    request = _request([b"\0" * 4096])
    request.id = "x" * 100
    raw = request.SerializeToString()
    head, _ = split_request(raw, 1 << 20)
    split_request(raw, len(head))  # at the cap: the 4096 raw bytes are not counted
    with pytest.raises(BodyTooLargeError, match="besides raw_input_contents"):
        split_request(raw, len(head) - 1)


def test_a_response_with_raw_contents_appended_is_what_protobuf_writes():
    response = pb.ModelInferResponse(model_name="mla_prefill", id="r1")
    response.outputs.add(name="out", datatype="BF16", shape=[2, 3])
    raws = [b"\x07" * 200_000, memoryview(b"\x08" * 5), b""]
    head = response.SerializeToString()
    for raw in raws:
        response.raw_output_contents.append(bytes(raw))
    assert pb.ModelInferResponse.FromString(response_bytes(head, raws)) == response


def test_a_retry_hint_travels_as_retry_info():
    error = grpc_error(zen_mla.QueueFullError("full", retry_after=2.5))
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    meta = dict(error.metadata)
    assert meta["retry-after"] == "3" and meta["zen-mla-status"] == "429"
    status = status_pb2.Status.FromString(meta["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and info.retry_delay.seconds == 3


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.0.0.7:5000", "10.0.0.7"),
        ("ipv6:[::1]:5000", "::1"),
        ("ipv6:%5B::1%5D:5000", "::1"),
        ("unix:/tmp/s", None),
        ("", None),
    ],
)
def test_the_peer_address(peer, host):
    assert peer_host(peer) == host


# -- counts on the wire ----------------------------------------------------------------------


def _typed(datatype: str, shape: list[int], **contents: list) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="mla_prefill")
    tensor = request.inputs.add(name="q", datatype=datatype, shape=shape)
    for name, values in contents.items():
        getattr(tensor.contents, name).extend(values)
    return request


def _with(make) -> bytes:
    request = pb.ModelInferRequest(model_name="mla_prefill")
    make(request)
    return request.SerializeToString()


def _params(target, n: int) -> None:
    for i in range(n):
        target.parameters[f"p{i}"].bool_param = True


def test_counts_at_their_bounds_pass_and_are_what_protobuf_reads():
    request = pb.ModelInferRequest(model_name="mla_prefill")
    _params(request, MAX_PARAMETERS)
    for i in range(MAX_TENSORS):
        tensor = request.inputs.add(name=f"t{i}", datatype="INT64", shape=[1] * MAX_DIMS)
        tensor.contents.int64_contents.append(-5)
        _params(tensor, MAX_PARAMETERS)
        _params(request.outputs.add(name=f"o{i}"), MAX_PARAMETERS)
    fp32 = request.inputs[0]
    fp32.datatype = "FP32"
    fp32.ClearField("contents")
    fp32.contents.fp32_contents.extend([0.5])
    raw = request.SerializeToString()
    for read in (split_request, _parsed_first):
        head, raws = read(raw, len(raw))
        assert raws == [] and pb.ModelInferRequest.FromString(head) == request


#: messages past a bound: what the refusal names
PAST_BOUNDS = {
    "dims_packed": (
        lambda r: r.inputs.add(name="q", datatype="BF16", shape=[1] * 9),
        "^q.shape: expected at most 8 dimensions, got 9$",
    ),
    "dims_unpacked": (
        None,  # written by hand below: one varint field per dim, as protobuf also reads
        "^q.shape: expected at most 8 dimensions, got 9$",
    ),
    "dims_unnamed": (
        lambda r: r.inputs.add(datatype="BF16", shape=[1] * 20),
        r"^inputs\[0\].shape: expected at most 8 dimensions, got 20$",
    ),
    "request_parameters": (
        lambda r: _params(r, 33),
        "^parameters: expected at most 32 entries, got more$",
    ),
    "input_parameters": (
        lambda r: _params(r.inputs.add(name="k"), 33),
        "^k.parameters: expected at most 32 entries",
    ),
    "output_parameters": (
        lambda r: _params(r.outputs.add(name="out"), 33),
        "^out.parameters: expected at most 32 entries",
    ),
    "inputs": (
        lambda r: [r.inputs.add(name="q") for _ in range(9)],
        "^inputs: expected at most 8 tensors, got more$",
    ),
    "outputs": (
        lambda r: [r.outputs.add(name="out") for _ in range(9)],
        "^outputs: expected at most 8 tensors, got more$",
    ),
}


@READS
@pytest.mark.parametrize("case", PAST_BOUNDS.values(), ids=PAST_BOUNDS.keys())
def test_a_count_past_its_bound_is_refused_naming_the_field(case, read):
    make, message = case
    if make is None:
        dims = b"".join(key(3, 0) + varint(1) for _ in range(9))
        raw = field(5, field(1, b"q") + field(2, b"BF16") + dims)
    else:
        raw = _with(make)
    with pytest.raises(zen_mla.InvalidInputError, match=message) as info:
        read(raw, 1 << 20)
    assert not isinstance(info.value, WireFormatError)
    assert grpc_error(info.value).code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_16m_dim_shape_is_counted_not_decoded():
    """Refused from one count of its bytes: nothing of 8 bytes a dim is made (protobuf would
    make 128 MiB of int64s, a list of them more)."""
    raw = field(5, field(1, b"q") + field(2, b"BF16") + field(3, b"\0" * 16_000_000))
    tracemalloc.start()
    try:
        with pytest.raises(zen_mla.InvalidInputError, match=r"got 16000000$"):
            split_request(raw, 1 << 25)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 17_000_000  # numpy's mask of the bytes that end a varint


#: typed contents that are not their datatype's, or not as many as the shape holds
TYPED = {
    "bf16": (
        _typed("BF16", [2], fp32_contents=[1, 2]),
        "^q.contents: expected BF16 as raw bytes .*no typed contents field, got fp32_contents$",
    ),
    "fp16_empty": (
        _typed("FP16", [0]),  # a contents field with no values is typed contents still
        "^q.contents: expected FP16 as raw bytes",
    ),
    "int8": (
        _typed("INT8", [2], int_contents=[1, 2]),
        "^q.contents: expected a datatype with typed contents",
    ),
    "other_field": (
        _typed("FP32", [2], fp64_contents=[1, 2]),
        "^q.contents: expected FP32 values in fp32_contents alone, got fp64_contents$",
    ),
    "two_fields": (
        _typed("INT32", [2], int_contents=[1, 2], bytes_contents=[b"x"]),
        "^q.contents: expected INT32 values in int_contents alone, got bytes_contents, int_c",
    ),
    "more": (
        _typed("FP32", [2, 3], fp32_contents=[0.0] * 7),
        r"^q.contents: expected 6 numbers \(FP32 \[2, 3\]\), got 7$",
    ),
    "fewer_int64": (
        _typed("INT64", [4], int64_contents=[1, -2, 3]),
        r"^q.contents: expected 4 numbers \(INT64 \[4\]\), got 3$",
    ),
    "negative_dim": (
        _typed("INT32", [-1, 2], int_contents=[1, 2]),
        "^q.shape: expected a list of whole numbers",
    ),
}


@READS
@pytest.mark.parametrize("case", TYPED.values(), ids=TYPED.keys())
def test_typed_contents_are_their_datatypes_and_as_many_as_the_shape(case, read):
    request, message = case
    if not request.inputs[0].HasField("contents"):
        request.inputs[0].contents.SetInParent()
    with pytest.raises(zen_mla.InvalidInputError, match=message) as info:
        read(request.SerializeToString(), 1 << 20)
    assert not isinstance(info.value, WireFormatError)


def test_typed_contents_unpacked_and_split_are_counted_as_protobuf_reads_them():
    """fp32 values one fixed32 field each, int32 values in two packed runs: both as many as
    the shape holds pass, and protobuf reads the same values."""
    floats = b"".join(key(6, 5) + struct.pack("<f", x) for x in (1.0, 2.0, 3.0))
    ints = field(2, varint(1) + varint(300)) + field(2, varint(5))
    for datatype, contents, want in (
        ("FP32", floats, [1.0, 2.0, 3.0]),
        ("INT32", ints, [1, 300, 5]),
    ):
        raw = field(
            5,
            field(1, b"q") + field(2, datatype.encode()) + field(3, varint(3)) + field(5, contents),
        )
        head, _ = split_request(raw, 1 << 20)
        tensor = pb.ModelInferRequest.FromString(head).inputs[0]
        assert list(getattr(tensor.contents, TYPED_FIELD[datatype])) == want


#: nested fields cut short or of the wrong wire type: refused as a broken message (400)
BROKEN = {
    "input_past_end": key(5, 2) + varint(50) + b"\x0a\x01q",
    "field_past_input": field(5, b"\x0a\x09q"),
    "varint_in_input": field(5, b"\x18" + b"\xff" * 11),
    "input_as_varint": key(5, 0) + varint(3),
    "name_as_varint": field(5, key(1, 0) + varint(1)),
    "shape_as_fixed32": field(5, key(3, 5) + b"\0\0\0\0"),
    "parameters_as_fixed64": field(5, key(4, 1) + b"\0" * 8),
    "contents_as_varint": field(5, key(5, 0) + varint(1)),
    "fp32_as_varint": field(5, field(2, b"FP32") + field(5, key(6, 0) + varint(1))),
    "contents_past_end": field(5, field(2, b"FP32") + field(5, key(6, 2) + varint(9) + b"\0")),
    "group_in_contents": field(5, field(5, key(6, 3))),
    "output_as_fixed32": key(6, 5) + b"\0\0\0\0",
    "parameter_as_varint": key(4, 0) + varint(1),
    "unpacked_past_budget": field(
        5, field(2, b"FP32") + field(5, (key(6, 5) + b"\0\0\0\0") * (MAX_FIELDS + 1))
    ),
}


@pytest.mark.parametrize("raw", BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_nested_field_is_refused_as_a_broken_message(raw):
    with pytest.raises(WireFormatError) as info:
        split_request(raw, 1 << 20)
    assert grpc_error(info.value).code == grpc.StatusCode.INVALID_ARGUMENT


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 400), st.binary(max_size=8))
def test_any_bytes_are_split_or_refused_never_a_crash(noise, at, insert):
    """Random bytes, and a good typed request with bytes cut in: split (protobuf may still
    refuse the head) or refused as a ZenMLAError, never another exception."""
    good = _typed("FP32", [2, 2], fp32_contents=[1.0, 2.0, 3.0, 4.0])
    good.parameters["causal"].bool_param = True
    good.outputs.add(name="out")
    _params(good.inputs[0], 3)
    raw = good.SerializeToString()
    for message in (noise, raw[:at] + insert + raw[at + len(insert) :], raw[:at]):
        try:
            parsed_first, _ = read_request(message, 1 << 20)
        except zen_mla.InvalidInputError:  # WireFormatError among them
            pass
        else:
            assert isinstance(parsed_first, pb.ModelInferRequest)
            assert len(parsed_first.inputs) <= MAX_TENSORS
            assert all(len(t.shape) <= MAX_DIMS for t in parsed_first.inputs)
        try:
            head, _ = split_request(message, 1 << 20)
        except (zen_mla.InvalidInputError, BodyTooLargeError):
            continue
        try:
            parsed = pb.ModelInferRequest.FromString(head)
        except DecodeError:
            continue
        assert len(parsed.inputs) <= MAX_TENSORS and len(parsed.parameters) <= MAX_PARAMETERS
        assert all(len(t.shape) <= MAX_DIMS for t in parsed.inputs)
