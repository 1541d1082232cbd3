"""The safetensors wire format: golden bytes, the reference library both ways, and a decoder
that answers every malformed header with a ValueError of ours."""

from __future__ import annotations

import contextlib
import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zen_mla import InvalidInputError, WireFormatError, wire

# {"x": F32 [2] = [1.0, 2.0]}, header padded with spaces to 8 bytes, as the format says
GOLDEN = (
    struct.pack("<Q", 56)
    + b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'.ljust(56)
    + struct.pack("<2f", 1.0, 2.0)
)


def as_body(data: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def test_golden_bytes():
    header, chunks = wire.encode({"x": torch.tensor([1.0, 2.0])})
    assert header + b"".join(bytes(c) for c in chunks) == GOLDEN
    tensors, meta = wire.decode(as_body(GOLDEN), frozenset({"x"}))
    assert torch.equal(tensors["x"], torch.tensor([1.0, 2.0])) and meta == {}


def test_reference_library_reads_ours_and_we_read_its():
    tensors = {
        "q": torch.randn(5, 2, 8).bfloat16(),
        "v": torch.randn(7, 2, 4).half(),
        "q_cu_seq_lens": torch.tensor([0, 5], dtype=torch.int32),
        "kv_cu_seq_lens": torch.tensor([0, 7]),
    }
    meta = {"causal": "false", "request_id": "r1"}
    header, chunks = wire.encode(tensors, meta)
    ours = header + b"".join(bytes(c) for c in chunks)
    back = safetensors.torch.load(ours)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    theirs = safetensors.torch.save(tensors, meta)
    got, got_meta = wire.decode(as_body(theirs), wire.REQUEST_TENSORS)
    assert all(torch.equal(got[k], v) for k, v in tensors.items()) and got_meta == meta


def test_decoded_tensors_are_views_of_the_body():
    header, chunks = wire.encode({"q": torch.arange(6.0)})
    body = as_body(header + b"".join(bytes(c) for c in chunks))
    tensors, _ = wire.decode(body, frozenset({"q"}))
    body[-4:] = 0  # the last float's bytes
    assert tensors["q"][-1].item() == 0.0


def _with_header(header: object, data: bytes = b"", raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


MALFORMED = {
    "empty": (b"", WireFormatError),
    "short": (b"\x01\x02", WireFormatError),
    "header_too_big": (struct.pack("<Q", 1 << 20) + b"{}", WireFormatError),
    "header_past_end": (struct.pack("<Q", 100) + b"{}", WireFormatError),
    "not_json": (_with_header(None, raw=b"{nope"), WireFormatError),
    "not_utf8": (_with_header(None, raw=b'{"\xff":1}'), WireFormatError),
    "not_object": (_with_header([1, 2]), WireFormatError),
    "entry_not_object": (_with_header({"q": 5}), WireFormatError),
    "unknown_dtype": (
        _with_header({"q": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
        WireFormatError,
    ),
    "negative_dim": (
        _with_header({"q": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
        WireFormatError,
    ),
    "huge_dims_overflow": (
        _with_header(
            {"q": {"dtype": "F32", "shape": [2**31, 2**31, 2**31], "data_offsets": [0, 4]}},
            b"\0" * 4,
        ),
        WireFormatError,
    ),
    "empty_view_of_huge_dims": (
        _with_header({"q": {"dtype": "F32", "shape": [2**47, 2**47, 0], "data_offsets": [0, 0]}}),
        WireFormatError,
    ),
    "size_mismatch": (
        _with_header({"q": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
        WireFormatError,
    ),
    "offsets_past_end": (
        _with_header({"q": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
        WireFormatError,
    ),
    "offsets_reversed": (
        _with_header({"q": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}, b"\0" * 4),
        WireFormatError,
    ),
    "overlap": (
        _with_header(
            {
                "q": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "k": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"\0" * 8,
        ),
        WireFormatError,
    ),
    "extra_field": (
        _with_header(
            {"q": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, b"\0" * 4
        ),
        WireFormatError,
    ),
    "metadata_not_strings": (_with_header({"__metadata__": {"causal": True}}), WireFormatError),
    "metadata_huge_value": (
        _with_header({"__metadata__": {"request_id": "x" * 10_000}}),
        WireFormatError,
    ),
    "duplicate_name": (
        _with_header(
            None,
            b"\0" * 4,
            raw=b'{"q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            b'"q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        ),
        WireFormatError,
    ),
    "deeply_nested": (_with_header(None, raw=b"[" * 60_000), WireFormatError),
    "unknown_name": (
        _with_header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
        InvalidInputError,
    ),
}


@pytest.mark.parametrize(("data", "error"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed(data, error):
    with pytest.raises(error) as info:
        wire.decode(as_body(data), wire.REQUEST_TENSORS)
    assert str(info.value).startswith(f"{info.value.name}: expected ")


def test_options():
    o = wire.parse_options(
        {"causal": "false", "return_lse": "TRUE", "scale": "0.125", "request_id": "a"}
    )
    assert (o.causal, o.return_lse, o.scale, o.kernel, o.request_id) == (
        False,
        True,
        0.125,
        "auto",
        "a",
    )
    for bad in (
        {"causal": "maybe"},
        {"scale": "x"},
        {"retrun_lse": "true"},
        {"request_id": "a\nb"},
    ):
        with pytest.raises(InvalidInputError):
            wire.parse_options(bad)


def _valid_body() -> bytes:
    header, chunks = wire.encode(
        {"q": torch.randn(3, 2, 4), "q_cu_seq_lens": torch.tensor([0, 3])}, {"causal": "true"}
    )
    return header + b"".join(bytes(c) for c in chunks)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_bodies_end_in_our_value_errors(data):
    """Flipped bytes, truncation and garbage: decode either succeeds or raises our ValueError."""
    body = bytearray(_valid_body())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    body = body[:cut] if data.draw(st.booleans()) else body
    try:
        tensors, meta = wire.decode(as_body(bytes(body)), wire.REQUEST_TENSORS)
        wire.parse_options(meta)
    except InvalidInputError:
        return
    for t in tensors.values():
        assert t.numel() * t.element_size() <= len(body)


@settings(max_examples=300, deadline=None)
@given(
    header=st.recursive(
        st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.text(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    ),
    data=st.binary(max_size=64),
)
def test_arbitrary_json_headers_end_in_our_value_errors(header, data):
    with contextlib.suppress(InvalidInputError):
        wire.decode(as_body(_with_header(header, data)), wire.REQUEST_TENSORS)
