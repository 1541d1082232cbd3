"""gRPC's pieces that need no server: a ModelInferRequest split around its raw contents as
protobuf would read it, every malformed message refused before protobuf sees it, a response
with raw contents appended as protobuf writes it, errors as statuses from the one table, and
a peer's address."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from tritonclient.grpc import service_pb2 as pb

import zen_mla
from service.doors import peer_host
from service.kserve.grpc_errors import CODES, grpc_error
from service.kserve.grpc_wire import MAX_FIELDS, response_bytes, split_request
from zen_mla.errors import STATUS, BodyTooLargeError, WireFormatError


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


def test_every_error_class_has_its_status_code():
    for cls, status in STATUS.items():
        exc = cls("x", "y", "z") if issubclass(cls, zen_mla.InvalidInputError) else cls("x")
        error = grpc_error(exc)
        assert error.code == CODES[status], cls
        assert dict(error.metadata)["zen-mla-status"] == str(status)
    assert grpc_error(zen_mla.UnauthorizedError("t")).code == grpc.StatusCode.UNAUTHENTICATED


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
