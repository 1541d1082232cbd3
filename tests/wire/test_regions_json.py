"""The regions request body (zen_mla.wire.regions_json): JSON places of tensors in regions."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zen_mla import InvalidInputError, WireFormatError
from zen_mla.wire import RESPONSE_TENSORS
from zen_mla.wire import regions_json as rr

NAMES = rr.REQUEST_NAMES
Q = rr.TensorPlace("h1", 0, "BF16", (4, 2, 8))


def test_round_trip():
    places = {"q": Q, "out": rr.TensorPlace("h2", 128, "F32", (2, 4))}
    got = rr.decode(rr.encode(places, {"causal": "false"}), NAMES)
    assert got.places == places and got.metadata == {"causal": "false"}
    assert Q.nbytes == 4 * 2 * 8 * 2


BAD_BODIES = {
    "not_json": (b"{", WireFormatError),
    "not_an_object": (b"[1]", WireFormatError),
    "duplicate_names": (b'{"q": 1, "q": 2}', WireFormatError),
    "deep": (b"[" * 100_000, WireFormatError),
    "too_long": (b" " * (rr.MAX_HEADER_BYTES + 1), WireFormatError),
    "unknown_tensor": (b'{"x": {"region": "h", "offset": 0, "dtype": "BF16", "shape": []}}', None),
    "missing_field": (b'{"q": {"region": "h", "offset": 0, "dtype": "BF16"}}', None),
    "extra_field": (
        b'{"q": {"region": "h", "offset": 0, "dtype": "BF16", "shape": [], "stride": []}}',
        None,
    ),
    "negative_offset": (
        b'{"q": {"region": "h", "offset": -64, "dtype": "BF16", "shape": []}}',
        None,
    ),
    "bool_offset": (b'{"q": {"region": "h", "offset": true, "dtype": "BF16", "shape": []}}', None),
    "negative_dim": (b'{"q": {"region": "h", "offset": 0, "dtype": "BF16", "shape": [-1]}}', None),
    "float_dim": (b'{"q": {"region": "h", "offset": 0, "dtype": "BF16", "shape": [1.5]}}', None),
    "five_dims": (
        b'{"q": {"region": "h", "offset": 0, "dtype": "BF16", "shape": [1,1,1,1,1]}}',
        None,
    ),
    "unknown_dtype": (b'{"q": {"region": "h", "offset": 0, "dtype": "Q4", "shape": []}}', None),
    "empty_handle": (b'{"q": {"region": "", "offset": 0, "dtype": "BF16", "shape": []}}', None),
    "long_handle": (
        b'{"q": {"region": "' + b"h" * 65 + b'", "offset": 0, "dtype": "BF16", "shape": []}}',
        None,
    ),
    "metadata_not_strings": (b'{"__metadata__": {"causal": true}}', None),
}


@pytest.mark.parametrize("body, error", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_bodies_are_named_errors(body, error):
    with pytest.raises(error or InvalidInputError):
        rr.decode(body, NAMES)


def _q(shape: object, offset: object = 0) -> bytes:
    place = {"region": "h", "offset": offset, "dtype": "BF16", "shape": shape}
    return json.dumps({"q": place}).encode()


#: counts past the cap every wire holds a client's to (MAX_DIM, 2^48): the field each names
PAST_THE_CAP = {
    "dim_2_64": (_q([1 << 64, 16, 192]), "q.shape"),
    "dim_2_48": (_q([4, 1 << 48, 192]), "q.shape"),
    "huge_dim_beside_a_zero": (_q([0, 1 << 64, 192]), "q.shape"),
    "elements_of_an_empty_view": (_q([1 << 47, 1 << 47, 0]), "q.shape"),
    "offset_2_64": (_q([4, 16, 192], 1 << 64), "q.offset"),
}


@pytest.mark.parametrize("body, field", PAST_THE_CAP.values(), ids=PAST_THE_CAP.keys())
def test_counts_past_the_cap_are_refused_naming_the_tensor_and_field(body, field):
    """A dim of 2^64 beside a 0 (a view of no bytes, which passes any range check) reached
    torch, whose view() overflowed: a 500 with a traceback in the service's log."""
    with pytest.raises(InvalidInputError) as refused:
        rr.decode(body, NAMES)
    assert refused.value.name == field
    assert "2^48" in str(refused.value)


#: dims as a client may send them: small, 0, or powers of two up to past any cap
_DIMS = st.integers(0, 64) | st.just(0) | st.integers(0, 70).map(lambda e: 1 << e)


@settings(max_examples=300, deadline=None)
@given(st.lists(_DIMS, max_size=4))
def test_every_shape_decoded_makes_a_view_of_its_bytes(shape):
    """What decodes is a shape torch can view its bytes as (no overflow of its sizes or
    strides), also where a 0 leaves no bytes to check a range by."""
    try:
        place = rr.decode(_q(shape), NAMES).places["q"]
    except InvalidInputError as exc:
        assert exc.name == "q.shape"
        return
    if place.nbytes <= 1 << 20:
        torch.empty(place.nbytes, dtype=torch.uint8).view(torch.bfloat16).view(place.shape)


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=20,
    )
)
def test_any_json_decodes_or_is_our_value_error(raw):
    try:
        message = rr.decode(json.dumps(raw).encode(), NAMES)
    except ValueError as exc:
        assert isinstance(exc, InvalidInputError | WireFormatError)
        return
    assert set(message.places) <= NAMES


def _body(offset: int) -> bytes:
    place = rr.TensorPlace("h1", offset, "BF16", (4, 16, 192))
    return rr.encode({"q": place}, {"causal": "true"})


def test_a_body_read_again_is_the_same_answer_in_dicts_of_its_own():
    first = rr.decode(_body(0), rr.REQUEST_NAMES)
    first.places.clear()
    first.metadata["causal"] = "false"
    again = rr.decode(_body(0), rr.REQUEST_NAMES)
    assert again.places == {"q": rr.TensorPlace("h1", 0, "BF16", (4, 16, 192))}
    assert again.metadata == {"causal": "true"}
    assert rr.decode(_body(64), rr.REQUEST_NAMES).places["q"].offset == 64
    # the names allowed are part of what is kept: the same body, read as an answer, is refused
    with pytest.raises(InvalidInputError, match="tensors among"):
        rr.decode(_body(0), RESPONSE_TENSORS)


def test_a_bad_body_is_refused_every_time_and_the_kept_ones_are_bounded():
    for _ in range(3):
        with pytest.raises(InvalidInputError, match=r"q\.offset"):
            rr.decode(
                b'{"q": {"region": "h", "offset": -1, "dtype": "BF16", "shape": [1]}}',
                rr.REQUEST_NAMES,
            )
    for offset in range(0, 64 * (rr.DECODED_KEPT + 10), 64):
        rr.decode(_body(offset), rr.REQUEST_NAMES)
    assert rr._decoded.cache_info().currsize == rr.DECODED_KEPT
