"""The Open Inference Protocol's (KServe v2) inference request and response, for the
`mla_prefill` model: the request's JSON read into a checked `InferRequest`, and the response's
JSON written. Where tensor bytes lie (after the JSON, in the JSON, in system shared memory) is
recorded here; `kserve.infer` and `kserve.outputs` fetch and write them.

Every rule broken names the tensor or field (`q.datatype: expected one of BF16, FP16, FP32, got
'INT8'`): a body that cannot be read as such a request is a 400 (`WireFormatError`), a request
that breaks the model's rules a 422 (`InvalidInputError`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from zen_mla import InvalidInputError, NotFoundError, WireFormatError
from zen_mla.wire import PrefillOptions, check_request_id
from zen_mla.wire.dtypes import BY_KSERVE, kserve_names

from .heads import SMALL_HEAD, check_shape, read_json
from .parameters import (
    ShmPlace,
    count,
    flag,
    kind,
    request_parameters,
    shm_place,
    tensor_parameters,
)

__all__ = [
    "INPUTS",
    "MODEL",
    "InferRequest",
    "InputSpec",
    "OutputSpec",
    "ShmPlace",
    "check_model",
    "model_metadata",
    "parse_request",
    "response_header",
]

MODEL = "mla_prefill"
VERSION = "1"
_VALUES = kserve_names("value")
_INDEXES = kserve_names("index")
#: inputs by name: the datatypes each may have, and the number of its dimensions
INPUTS: dict[str, tuple[tuple[str, ...], int]] = {
    "q": (_VALUES, 3),
    "k": (_VALUES, 3),
    "v": (_VALUES, 3),
    "kv_c": (_VALUES, 2),
    "k_pe": (_VALUES, 2),
    "q_cu_seq_lens": (_INDEXES, 1),
    "kv_cu_seq_lens": (_INDEXES, 1),
}
REQUIRED = ("q", "k", "v", "q_cu_seq_lens")
#: over MLA's latent cache: kv_c and k_pe in place of k and v, and the weight a parameter names
LATENT_REQUIRED = ("q", "kv_c", "k_pe", "q_cu_seq_lens")
OUTPUTS = ("out", "lse")


def check_model(model: str, version: str) -> None:
    """NotFoundError unless `model` (and `version`, where given) name this model."""
    if model != MODEL:
        raise NotFoundError(f"no model named {model[:80]!r} here; this server serves {MODEL}")
    if version not in ("", VERSION):
        raise NotFoundError(f"model {MODEL} has version {VERSION} only, not {version[:20]!r}")


def model_metadata() -> dict[str, Any]:
    """`GET /v2/models/mla_prefill`: `datatype` is the reference model's; `parameters` lists
    every datatype an input may have."""

    def tensor(name: str, datatype: str, shape: list[int], **extra: Any) -> dict[str, Any]:
        kinds = list(INPUTS[name][0]) if name in INPUTS else [datatype]
        return {
            "name": name,
            "datatype": datatype,
            "shape": shape,
            "parameters": {"datatypes": kinds, **extra},
        }

    return {
        "name": MODEL,
        "versions": [VERSION],
        "platform": "zen-mla",
        "inputs": [
            tensor("q", "BF16", [-1, -1, -1]),
            tensor("k", "BF16", [-1, -1, -1]),
            tensor("v", "BF16", [-1, -1, -1]),
            tensor("kv_c", "BF16", [-1, -1], optional=True, note="latent: in place of k, v"),
            tensor("k_pe", "BF16", [-1, -1], optional=True, note="latent: in place of k, v"),
            tensor("q_cu_seq_lens", "INT32", [-1]),
            tensor("kv_cu_seq_lens", "INT32", [-1], optional=True),
        ],
        "outputs": [
            {
                "name": "out",
                "datatype": "BF16",
                "shape": [-1, -1, -1],
                "parameters": {"datatypes": list(_VALUES), "note": "v's datatype"},
            },
            {"name": "lse", "datatype": "FP32", "shape": [-1, -1]},
        ],
    }


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One input: its datatype and shape, and where its bytes are: `binary` (offset into the
    binary part of the body), `shm`, or `data` (JSON numbers)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    binary: int | None = None
    shm: ShmPlace | None = None
    data: Any = None

    @property
    def dtype(self) -> torch.dtype:
        return BY_KSERVE[self.datatype].torch

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One output to return: binary after the JSON, JSON `data`, or written to `shm`."""

    name: str
    binary: bool = False
    shm: ShmPlace | None = None


@dataclass(frozen=True, slots=True)
class InferRequest:
    id: str | None
    inputs: dict[str, InputSpec]
    outputs: tuple[OutputSpec, ...]
    causal: bool = True
    return_lse: bool = False
    scale: float | None = None
    kernel: str = "auto"
    binary_bytes: int = 0
    timeout: float | None = None  # the caller's seconds (its `timeout` parameter)
    form: str = "auto"  # over the latent cache: how it is attended
    weight: str | None = None  # over the latent cache: the registered w_kv_b it names
    precision: str = "auto"  # over the latent cache: what its products are multiplied in
    uses_shm: bool = field(init=False)

    def __post_init__(self) -> None:
        shm = any(i.shm for i in self.inputs.values()) or any(o.shm for o in self.outputs)
        object.__setattr__(self, "uses_shm", shm)

    @property
    def options(self) -> PrefillOptions:
        return PrefillOptions(
            self.causal,
            self.return_lse,
            self.scale,
            self.kernel,
            self.id,
            form=self.form,
            weight=self.weight,
            precision=self.precision,
        )


def parse_header(raw: bytes | memoryview) -> object:
    """The request's JSON (an unreadable one is a 400). One over SMALL_HEAD bytes is walked
    first (`heads.read_json`): its counts are held to their bounds before json.loads makes
    objects of it."""
    text = bytes(raw)
    if len(text) > SMALL_HEAD:
        text = read_json(text)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        got = f"{type(exc).__name__}: {str(exc)[:120]}"
        raise WireFormatError("inference header", "a JSON object", got) from None


def parse_request(doc: object, binary_bytes: int) -> InferRequest:
    """The request `doc` (parsed JSON) with `binary_bytes` of tensor data after it."""
    if not isinstance(doc, dict):
        raise WireFormatError("inference header", "a JSON object", type(doc).__name__)
    unknown = sorted(set(doc) - {"id", "inputs", "outputs", "parameters"})
    if unknown:
        raise InvalidInputError(
            "request", "fields among id, inputs, outputs, parameters", repr(unknown[0])[:60]
        )
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInputError("id", "a string", type(request_id).__name__)
    check_request_id("id", request_id)
    params = request_parameters(doc.get("parameters"))

    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list):
        raise InvalidInputError("inputs", "a list of input tensors", kind(raw_inputs))
    inputs: dict[str, InputSpec] = {}
    at = 0  # the binary part's bytes taken by the inputs so far, in their order
    for raw in raw_inputs:
        spec = _input(raw, at)
        if spec.name in inputs:
            raise InvalidInputError(spec.name, "one input of that name", "two")
        inputs[spec.name] = spec
        if spec.binary is not None:
            at += spec.nbytes
    latent = "kv_c" in inputs or "k_pe" in inputs
    for name in LATENT_REQUIRED if latent else REQUIRED:
        if name not in inputs:
            raise InvalidInputError(name, "an input of that name in the request", "none")
    if latent:
        for name in ("k", "v"):
            if name in inputs:
                raise InvalidInputError(name, "no k or v beside kv_c (the latent cache)", "one")
        if "weight" not in params:
            raise InvalidInputError(
                "parameters.weight",
                "the name of a registered w_kv_b beside kv_c (PUT /weights/{name})",
                "none",
            )
    elif "weight" in params:
        raise InvalidInputError(
            "parameters.weight", "none without kv_c (a request over the latent cache)", "one"
        )
    if at != binary_bytes:
        raise WireFormatError(
            "binary_data_size",
            f"sizes adding up to the {binary_bytes} bytes after the inference header",
            f"{at} bytes",
        )
    return_lse = bool(params.get("return_lse", False))
    outputs = _outputs(doc.get("outputs"), return_lse, bool(params.get("binary_data_output")))
    return InferRequest(
        id=request_id,
        inputs=inputs,
        outputs=outputs,
        causal=bool(params.get("causal", True)),
        return_lse=return_lse,
        scale=params.get("scale"),
        kernel=params.get("kernel", "auto"),
        binary_bytes=binary_bytes,
        timeout=params.get("timeout"),
        form=params.get("form", "auto"),
        weight=params.get("weight"),
        precision=params.get("precision", "auto"),
    )


def _input(raw: object, binary_at: int) -> InputSpec:
    if not isinstance(raw, dict):
        raise InvalidInputError("inputs", "a list of input tensors (JSON objects)", kind(raw))
    name = raw.get("name")
    if name not in INPUTS:
        raise InvalidInputError("inputs", f"input names among {', '.join(INPUTS)}", repr(name)[:60])
    assert isinstance(name, str)
    kinds, ndim = INPUTS[name]
    datatype = raw.get("datatype")
    if datatype not in kinds:
        raise InvalidInputError(
            f"{name}.datatype", f"one of {', '.join(kinds)}", repr(datatype)[:40]
        )
    shape = check_shape(name, raw.get("shape"))
    if len(shape) != ndim:
        layout = {3: "[T, H, D]", 2: "[Tk, D]"}.get(ndim, "[B + 1]")
        raise InvalidInputError(
            f"{name}.shape", f"{ndim} dimensions {layout}", str(list(shape))[:60]
        )
    params = tensor_parameters(name, raw.get("parameters"), "binary_data_size")
    spec = InputSpec(name, datatype, tuple(shape))
    shm = shm_place(name, params)
    sources = [
        k
        for k, on in (
            ("binary_data_size", "binary_data_size" in params),
            ("shared memory", shm is not None),
            ("data", "data" in raw),
        )
        if on
    ]
    if len(sources) != 1:
        raise InvalidInputError(
            name,
            "its bytes from one of binary_data_size, shared memory, data",
            " and ".join(sources) or "none",
        )
    if shm is not None:
        if shm.byte_size != spec.nbytes:
            raise InvalidInputError(
                f"{name}.shared_memory_byte_size",
                f"{spec.nbytes} bytes ({datatype} {list(shape)})",
                str(shm.byte_size),
            )
        return InputSpec(name, datatype, spec.shape, shm=shm)
    if "binary_data_size" in params:
        size = count(f"{name}.binary_data_size", params["binary_data_size"])
        if size != spec.nbytes:
            raise InvalidInputError(
                f"{name}.binary_data_size",
                f"{spec.nbytes} bytes ({datatype} {list(shape)})",
                str(size),
            )
        return InputSpec(name, datatype, spec.shape, binary=binary_at)
    return InputSpec(name, datatype, spec.shape, data=raw["data"])


def _outputs(raw: object, return_lse: bool, binary_default: bool) -> tuple[OutputSpec, ...]:
    if raw is None:
        names = ("out", "lse") if return_lse else ("out",)
        return tuple(OutputSpec(n, binary=binary_default) for n in names)
    if not isinstance(raw, list):
        raise InvalidInputError("outputs", "a list of requested outputs", kind(raw))
    specs: dict[str, OutputSpec] = {}
    for item in raw:
        name = item.get("name") if isinstance(item, dict) else None
        if name not in OUTPUTS:
            raise InvalidInputError("outputs", "output names among out, lse", repr(name)[:60])
        assert isinstance(item, dict) and isinstance(name, str)
        if name in specs:
            raise InvalidInputError(name, "one requested output of that name", "two")
        if name == "lse" and not return_lse:
            raise InvalidInputError(
                "lse", "the parameter return_lse: true to compute it", "return_lse false"
            )
        params = tensor_parameters(name, item.get("parameters"), "binary_data")
        binary = flag(f"{name}.binary_data", params.get("binary_data", binary_default))
        specs[name] = OutputSpec(name, binary=binary, shm=shm_place(name, params))
    return tuple(specs.values())


def response_header(
    request: InferRequest,
    outputs: list[dict[str, Any]],
    meta: Mapping[str, str],
) -> bytes:
    """The response's JSON: the model, the request's id, what computed the outputs
    (`parameters`), and each output's entry."""
    doc: dict[str, Any] = {"model_name": MODEL, "model_version": VERSION}
    if request.id is not None:
        doc["id"] = request.id
    doc["parameters"] = dict(meta)
    doc["outputs"] = outputs
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
