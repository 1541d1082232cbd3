"""The v2 inference request's JSON read into an InferRequest (no server): where each input's
bytes lie, which outputs come back how, and every broken rule named; a big head walked on its
bytes first (`kserve.heads`), every count past its bound refused before json.loads builds it."""

from __future__ import annotations

import codecs
import copy
import json
import math
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.kserve import request as kr
from service.kserve.heads import MAX_DIMS, MAX_PARAMETERS, MAX_TENSORS, SMALL_HEAD, read_json
from zen_mla import InvalidInputError, WireFormatError

Q = {"name": "q", "datatype": "BF16", "shape": [5, 2, 192]}
K = {"name": "k", "datatype": "BF16", "shape": [7, 2, 192]}
V = {"name": "v", "datatype": "BF16", "shape": [7, 2, 128]}
CU = {"name": "q_cu_seq_lens", "datatype": "INT32", "shape": [2]}
SIZES = {"q": 5 * 2 * 192 * 2, "k": 7 * 2 * 192 * 2, "v": 7 * 2 * 128 * 2, "q_cu_seq_lens": 8}


def binary_request(**extra: object) -> dict:
    inputs = []
    for spec in (CU, Q, K, V):  # cu first: offsets follow the inputs' order, not their names
        entry = copy.deepcopy(spec)
        entry["parameters"] = {"binary_data_size": SIZES[spec["name"]]}
        inputs.append(entry)
    return {"inputs": inputs, **extra}


def test_binary_inputs_lie_one_after_another_in_input_order():
    req = kr.parse_request(binary_request(id="r1"), sum(SIZES.values()))
    assert req.id == "r1" and req.causal and not req.return_lse and req.kernel == "auto"
    assert [req.inputs[n].binary for n in ("q_cu_seq_lens", "q", "k", "v")] == [
        0,
        8,
        8 + SIZES["q"],
        8 + SIZES["q"] + SIZES["k"],
    ]
    assert [(o.name, o.binary, o.shm) for o in req.outputs] == [("out", False, None)]
    assert not req.uses_shm


def test_outputs_by_default_follow_return_lse_and_binary_data_output():
    doc = binary_request(parameters={"return_lse": True, "binary_data_output": True})
    req = kr.parse_request(doc, sum(SIZES.values()))
    assert [(o.name, o.binary) for o in req.outputs] == [("out", True), ("lse", True)]
    doc["outputs"] = [{"name": "lse"}, {"name": "out", "parameters": {"binary_data": False}}]
    req = kr.parse_request(doc, sum(SIZES.values()))
    assert [(o.name, o.binary) for o in req.outputs] == [("lse", True), ("out", False)]


def test_shared_memory_places_and_json_data():
    doc = {
        "inputs": [
            Q | {"parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 3840}},
            K | {"parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 5376,
                                "shared_memory_offset": 3840}},
            V | {"data": [0.0] * (7 * 2 * 128)},
            CU | {"data": [0, 5]},
        ],
        "outputs": [{"name": "out", "parameters": {"shared_memory_region": "o",
                                                   "shared_memory_byte_size": 2560}}],
    }  # fmt: skip
    req = kr.parse_request(doc, 0)
    assert req.inputs["k"].shm == kr.ShmPlace("in", 3840, 5376)
    assert req.inputs["v"].data is not None and req.inputs["v"].binary is None
    assert req.outputs[0].shm == kr.ShmPlace("o", 0, 2560) and req.uses_shm


def _break(doc: dict, path: tuple, value: object) -> dict:
    doc = copy.deepcopy(doc)
    target = doc
    for step in path[:-1]:
        target = target[step]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


TOTAL = sum(SIZES.values())
CASES = {
    "datatype": (("inputs", 1, "datatype"), "INT8", "^q.datatype: expected one of BF16"),
    "cu datatype": (("inputs", 0, "datatype"), "FP32", "^q_cu_seq_lens.datatype: expected"),
    "dims": (("inputs", 1, "shape"), [10, 192], r"^q.shape: expected 3 dimensions \[T, H, D\]"),
    "negative dim": (("inputs", 1, "shape"), [-1, 2, 192], "^q.shape: expected a list of whole"),
    "size": (("inputs", 2, "parameters", "binary_data_size"), 10, "^k.binary_data_size: "),
    "unknown input": (("inputs", 1, "name"), "query", "^inputs: expected input names among"),
    "duplicate": (("inputs", 2, "name"), "q", "^q: expected one input of that name"),
    "unknown param": (("parameters",), {"casual": False}, "^parameters: expected names among"),
    "scale": (("parameters",), {"scale": 0}, "^scale: expected a finite number > 0"),
    "flag": (("parameters",), {"causal": "yes"}, "^causal: expected true or false"),
    "input param": (("inputs", 1, "parameters", "x"), 1, r"^q.parameters: expected names"),
    "two sources": (("inputs", 1, "data"), [1], "^q: expected its bytes from one of"),
    "lse unasked": (("outputs",), [{"name": "lse"}], "^lse: expected the parameter return_lse"),
    "bad output": (("outputs",), [{"name": "o"}], "^outputs: expected output names among"),
    "field": (("model",), "x", "^request: expected fields among"),
    "id": (("id",), 5, "^id: expected a string"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_broken_rule_is_named(case):
    path, value, message = case
    with pytest.raises(InvalidInputError, match=message) as info:
        kr.parse_request(_break(binary_request(), path, value), TOTAL)
    assert not isinstance(info.value, WireFormatError)  # a 422, not a 400


def test_a_missing_input_and_sizes_that_do_not_add_up():
    doc = binary_request()
    del doc["inputs"][1]
    with pytest.raises(InvalidInputError, match=r"^q: expected an input of that name"):
        kr.parse_request(doc, TOTAL - SIZES["q"])
    with pytest.raises(WireFormatError, match=f"the {TOTAL + 1} bytes after the inference"):
        kr.parse_request(binary_request(), TOTAL + 1)


@pytest.mark.parametrize("raw", [b"{", b"[1]", b"\xff", b"[" * 100_000], ids=repr)
def test_an_unreadable_header_is_a_wire_format_error(raw):
    with pytest.raises(WireFormatError, match=r"^inference header: expected a JSON object"):
        kr.parse_request(kr.parse_header(raw), 0)


def test_response_header_names_the_model_and_what_computed():
    req = kr.parse_request(binary_request(id="x"), TOTAL)
    head = json.loads(kr.response_header(req, [{"name": "out"}], {"kernel": "torch"}))
    assert head == {
        "model_name": "mla_prefill",
        "model_version": "1",
        "id": "x",
        "parameters": {"kernel": "torch"},
        "outputs": [{"name": "out"}],
    }


def test_model_metadata_lists_every_tensor():
    meta = kr.model_metadata()
    assert [t["name"] for t in meta["inputs"]] == list(kr.INPUTS)
    assert [t["name"] for t in meta["outputs"]] == ["out", "lse"]
    assert meta["inputs"][4]["parameters"]["optional"] is True


# -- a JSON head walked on its bytes ---------------------------------------------------------


def _head(inputs: list[dict], **extra: object) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def test_a_head_within_the_bounds_is_what_json_loads_reads():
    doc = binary_request(id="r1", parameters={f"p{i}": i for i in range(MAX_PARAMETERS)})
    doc["inputs"].append(V | {"name": "v2", "data": [[[0.5] * 128] * 2] * 7})  # nested data
    doc["inputs"].append(CU | {"name": "cu2", "shape": [4], "data": [0, 5e0, -1, 1.5e-3]})
    doc["inputs"][0]["data"] = []  # with shape [0]
    doc["inputs"][0]["shape"] = [0]
    doc["outputs"] = [{"name": "out", "parameters": {"binary_data": True}}]
    raw = json.dumps(doc, indent=1).encode()  # whitespace everywhere
    assert read_json(raw) is raw


#: heads of odd but readable JSON: walked, and left to the request's rules
ODD = {
    "inputs_object": b'{"inputs": {"name": "q"}}',
    "outputs_string": b'{"outputs": "out"}',
    "data_scalar": b'{"inputs": [{"name": "q", "data": 5}]}',
    "data_non_finite": b'{"inputs": [{"shape": [3], "data": [NaN, Infinity, -Infinity]}]}',
    "escaped_names": b'{"inputs": [{"\\u0064ata": [1, 2], "n\\u0061me": "q\\"", "shape": [2]}]}',
    "bom": codecs.BOM_UTF8 + b'{"id": "r"}',
    "empty": b"{}",
}


@pytest.mark.parametrize("raw", ODD.values(), ids=ODD.keys())
def test_odd_but_readable_heads_are_walked_as_json_loads_reads_them(raw):
    assert json.loads(read_json(raw)) == json.loads(raw)


#: heads past a bound, and what the refusal names
PAST = {
    "dims": (_head([Q | {"shape": [1] * 9}]), r"^q.shape: expected at most 8 dimensions, got 9$"),
    "dims_unnamed": (
        _head([{"shape": [0] * 20, "name": "q"}]),
        r"^inputs\[0\].shape: expected at most 8 dimensions, got 20$",
    ),
    "dims_not_numbers": (
        _head([Q | {"shape": [1, "x"] * 5}]),
        r"^q.shape: expected at most 8 dimensions, got 9 or more$",
    ),
    "inputs": (_head([Q] * 9), "^inputs: expected at most 8 tensors, got 9$"),
    "outputs": (_head([], outputs=[{"name": "out"}] * 9), "^outputs: expected at most 8"),
    "parameters": (
        _head([], parameters={f"p{i}": True for i in range(33)}),
        "^parameters: expected at most 32 entries, got more$",
    ),
    "tensor_parameters": (
        _head([Q | {"parameters": {f"p{i}": 1 for i in range(40)}}]),
        "^q.parameters: expected at most 32 entries",
    ),
    "deep": (
        _head([], parameters={"causal": [[[True]]]}),
        r"^parameters.causal\[0\]\[0\]: expected lists and objects nested at most 4 deep",
    ),
    "containers": (
        _head([], x=[{}] * 30, y=[{}] * 30, z=[{}] * 30),
        "^.*: expected at most 64 lists and objects in the request, got more$",
    ),
    "string": (_head([], id="x" * 4097), "^id: expected a string of at most 4096 bytes"),
    "data_flat": (
        _head([CU | {"data": list(range(3))}]),
        r"^q_cu_seq_lens.data: expected 2 numbers \(INT32 \[2\]\), got 3$",
    ),
    "data_nested": (
        _head([Q | {"datatype": "FP32", "shape": [2, 1, 2], "data": [[[1, 2]], [[3]]]}]),
        r"^q.data: expected 4 numbers \(FP32 \[2, 1, 2\]\), got 3$",
    ),
    "data_lists": (
        _head([Q | {"shape": [1, 1, 1], "data": [[], [], [], [1]]}]),
        r"^q.data: expected numbers in at most 3 lists \(BF16 \[1, 1, 1\]: flat, or nested",
    ),
    "data_other_values": (
        _head([CU | {"data": [0, "5"]}]),
        r"^q_cu_seq_lens.data: expected a list of numbers \(flat or nested\), got other values$",
    ),
    "data_objects": (
        _head([CU | {"data": [{}, {}]}]),
        r"^q_cu_seq_lens.data: expected a list of numbers",
    ),
    "data_shape_string": (
        b'{"inputs": [{"shape": "3", "data": []}]}',
        r"^inputs\[0\].shape: expected a list of whole numbers",
    ),
    "data_escaped": (
        b'{"inputs": [{"n\\u0061me": "q\\u00e9", "shape": [2], "\\u0064ata": [1]}]}',
        r"^q\u00e9.data: expected 2 numbers \(\? \[2\]\), got 1$",
    ),
    "data_no_shape": (
        _head([{"name": "q", "data": [1, 2]}]),
        "^q.shape: expected a list of whole numbers",
    ),
    "data_twice": (  # json.loads builds both, and keeps the last
        b'{"inputs": [{"name": "q_cu_seq_lens", "shape": [2], "data": [0, 0, 0], "data": [0, 1]}]}',
        r"^q_cu_seq_lens.data: expected 2 numbers \(\? \[2\]\), got 3$",
    ),
}


@pytest.mark.parametrize("case", PAST.values(), ids=PAST.keys())
def test_a_count_past_its_bound_is_refused_before_json_loads(case):
    raw, message = case
    with pytest.raises(InvalidInputError, match=message) as info:
        read_json(raw)
    assert not isinstance(info.value, WireFormatError)  # a 422, naming the field


@pytest.mark.parametrize(
    "raw",
    [b"", b"[1]", b"\xff", b"{", b'{"a" 1}', b'{"a": 1,}', b'{"a": [1 2]', b'{"a": tru}',
     b'{"a": "\x01"}', b'{"a": 1} x', b'{"a": [[[' , b'{"inputs": [{"data": [1,'],
    ids=repr,
)  # fmt: skip
def test_a_head_that_cannot_be_walked_is_a_wire_format_error(raw):
    with pytest.raises(WireFormatError, match=r"^inference header: expected a JSON object"):
        read_json(raw)


def test_a_big_head_is_walked_before_json_loads_and_a_small_one_is_not():
    """parse_header walks a head over SMALL_HEAD bytes; one of 16 MiB of one list is refused
    having made no object of its numbers (tracemalloc sees a few KiB)."""
    small = _head([Q | {"shape": [0] * 100}])
    with pytest.raises(InvalidInputError, match=r"^q.shape: expected 3 dimensions"):
        kr.parse_request(kr.parse_header(small), 0)  # json.loads, then the request's rules
    big = _head([Q | {"shape": [0] * (SMALL_HEAD // 2)}])
    with pytest.raises(InvalidInputError, match=r"^q.shape: expected at most 8 dimensions"):
        kr.parse_header(big)
    huge = b'{"inputs": [{"name": "q", "shape": [' + b"0," * (8 << 20) + b"0]}]}"
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInputError, match=f"got {(8 << 20) + 1}$"):
            kr.parse_header(huge)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(huge) + (1 << 20)  # bytes(raw)'s copy, no list of 8M numbers


def test_non_ascii_strings_are_escaped_so_the_head_decodes_as_ascii():
    doc = {"id": "r\U0001f600é", "inputs": [CU | {"data": [0, 5]}], "parameters": {"k": "ü"}}
    raw = json.dumps(doc, ensure_ascii=False).encode()
    out = read_json(raw)
    assert out.isascii() and json.loads(out) == json.loads(raw) == doc


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=6)
    ),
    max_leaves=30,
)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["id", "inputs", "outputs", "parameters", "x"]), JSON_VALUES)
    | JSON_VALUES,
    st.integers(0, 400),
    st.binary(max_size=3),
)
def test_any_head_is_read_as_json_loads_reads_it_or_refused(doc, at, insert):
    """A head json.loads reads the same after the walk, or refused as a ZenMLAError (by the
    walk, or by the parse after it where the walk let a broken escape through); with bytes cut
    in, the same: never another exception."""
    raw = json.dumps(doc, ensure_ascii=at % 2 == 0).encode()
    for text in (raw, raw[:at] + insert + raw[at + len(insert) :]):
        try:
            want = json.loads(text)
        except (ValueError, RecursionError):
            want = None  # broken: refused either way
        try:
            walked = read_json(text)
        except WireFormatError:
            assert want is None or not isinstance(want, dict), text  # only what is no object
            continue
        except InvalidInputError:
            continue  # past a bound
        if want is None:  # the walk need not see every break: the parse after it refuses it
            with pytest.raises(ValueError):
                json.loads(walked)
        else:
            assert json.loads(walked) == want


def _nested(values: list, shape: list[int]) -> list:
    """`values` as lists nested by `shape` (row-major)."""
    if len(shape) <= 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_nested(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


@st.composite
def _tensors(draw: st.DrawFn) -> dict:
    shape = draw(st.lists(st.integers(1, 3), max_size=MAX_DIMS))
    tensor = {
        "name": draw(st.text(max_size=10)),
        "datatype": draw(st.sampled_from(["FP32", "INT64"])),
        "shape": shape,
        "parameters": draw(st.dictionaries(st.text(max_size=5), SCALARS, max_size=MAX_PARAMETERS)),
    }
    if draw(st.booleans()):
        values = draw(st.lists(NUMBERS, min_size=math.prod(shape), max_size=math.prod(shape)))
        tensor["data"] = _nested(values, shape) if draw(st.booleans()) else values
    return tensor


SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
NUMBERS = st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(_tensors(), max_size=MAX_TENSORS),
    st.lists(_tensors(), max_size=MAX_TENSORS),
    st.dictionaries(st.text(max_size=5), SCALARS, max_size=MAX_PARAMETERS),
    st.sampled_from([None, 0, 2]),
    st.booleans(),
)
def test_a_request_within_every_bound_is_never_refused(inputs, outputs, params, indent, ascii_):
    """Tensors (data flat or nested by the shape), outputs and parameters up to their bounds,
    written with or without whitespace and escapes: walked, and read as json.loads reads them."""
    doc = {"id": "r", "inputs": inputs, "outputs": outputs, "parameters": params}
    raw = json.dumps(doc, indent=indent, ensure_ascii=ascii_).encode()
    walked = read_json(raw)
    assert walked == raw or json.loads(walked) == json.loads(raw)
