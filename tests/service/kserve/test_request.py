"""The v2 inference request's JSON read into an InferRequest (no server): where each input's
bytes lie, which outputs come back how, and every broken rule named."""

from __future__ import annotations

import copy
import json

import pytest

from service.kserve import request as kr
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
