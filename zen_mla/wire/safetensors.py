"""The wire format: one safetensors file per request and per response, parsed by hand.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (an object of
`name -> {"dtype", "shape", "data_offsets": [begin, end]}` plus an optional `__metadata__` of
string values), then the tensor bytes, offsets relative to the end of the header.

The decoder never trusts the header: its size, the tensor count, every shape and offset are
checked against the bytes that came, and tensors are views of the received buffer (no copy).
The encoder gives the header and the tensors' bytes separately, so they can be sent as they lie.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..copying import copied
from ..errors import InvalidInputError, WireFormatError
from .dtypes import BY_SAFETENSORS, BY_TORCH

__all__ = [
    "LATENT_METADATA",
    "LATENT_TENSORS",
    "MAX_DIM",
    "MAX_HEADER_BYTES",
    "MAX_METADATA_VALUE",
    "MAX_REQUEST_ID",
    "REQUEST_TENSORS",
    "RESPONSE_TENSORS",
    "WEIGHT_NAME",
    "PrefillOptions",
    "check_request_id",
    "check_weight_name",
    "decode",
    "encode",
    "header_length",
    "options_metadata",
    "parse_options",
    "tensor_bytes",
    "viewable",
]

#: generous for five tensors and the metadata (a real request header is ~600 bytes)
MAX_HEADER_BYTES = 64 << 10
MAX_METADATA_VALUE = 256
REQUEST_TENSORS = frozenset({"q", "k", "v", "q_cu_seq_lens", "kv_cu_seq_lens"})
#: a safetensors request over MLA's latent cache carries these in place of k and v
LATENT_TENSORS = frozenset({"kv_c", "k_pe"})
RESPONSE_TENSORS = frozenset({"out", "lse"})
MAX_DIM = 1 << 48  # a dimension's cap, whatever the wire: well past memory, far below 2^63


def viewable(shape: Sequence[int]) -> bool:
    """Whether a shape of dims each below MAX_DIM has fewer than MAX_DIM elements counting a 0
    dim as 1, as every wire requires: torch sizes a view of no elements by its other dims all
    the same, and [2^47, 2^47, 0] overflows them (a RuntimeError past the checks)."""
    elements = 1
    for d in shape:
        elements *= max(d, 1)
    return elements < MAX_DIM


MAX_REQUEST_ID = 128  # characters of a request id (echoed and logged)
REQUEST_METADATA = frozenset({"causal", "return_lse", "scale", "kernel", "request_id"})
#: and these options: how it is attended, in what precision, and the registered weight it names
LATENT_METADATA = frozenset({"form", "precision", "weight"})
#: a registered weight's name (`PUT /weights/{name}`; a latent request's `weight`)
WEIGHT_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def header_length(prefix: bytes | memoryview, body_bytes: int) -> int:
    """N from the first 8 bytes, checked against the cap and the body's size."""
    if body_bytes < 8 or len(prefix) < 8:
        raise WireFormatError(
            "body", "a safetensors file (8-byte header length first)", f"{body_bytes} bytes"
        )
    n: int = struct.unpack("<Q", prefix[:8])[0]
    if n > MAX_HEADER_BYTES:
        raise WireFormatError("header", f"at most {MAX_HEADER_BYTES} bytes", f"{n} bytes")
    if 8 + n > body_bytes:
        raise WireFormatError(
            "header", f"to fit in the {body_bytes}-byte body", f"a header of {n} bytes"
        )
    return n


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        names = [k for k, _ in pairs]
        twice = sorted({k for k in names if names.count(k) > 1})
        raise WireFormatError("header", "each name once", f"{twice[:3]} more than once")
    return out


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _entry(name: str, raw: object, data_bytes: int) -> _Entry:
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise WireFormatError(
            name, 'an object with "dtype", "shape", "data_offsets"', repr(raw)[:80]
        )
    entry = BY_SAFETENSORS.get(raw["dtype"]) if isinstance(raw["dtype"], str) else None
    dtype = entry.torch if entry is not None else None
    if dtype is None:
        raise WireFormatError(
            name, f"a dtype among {', '.join(BY_SAFETENSORS)}", repr(raw["dtype"])[:40]
        )
    shape = raw["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > 8
        or not all(type(d) is int and 0 <= d < MAX_DIM for d in shape)
        or not viewable(shape)
    ):
        raise WireFormatError(
            name,
            "a shape of at most 8 dims, each 0 <= d < 2^48, of fewer than 2^48 elements (a 0 dim "
            "counted as 1)",
            repr(shape)[:80],
        )
    offsets = raw["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise WireFormatError(
            name,
            f"data_offsets [begin, end] within the {data_bytes} data bytes",
            repr(offsets)[:80],
        )
    size = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != size:
        raise WireFormatError(
            name,
            f"{size} bytes for shape {shape} of {raw['dtype']}",
            f"{offsets[1] - offsets[0]} bytes",
        )
    return _Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def decode(
    body: torch.Tensor, allowed: frozenset[str]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (views of `body`, a uint8 tensor holding the whole file) and the metadata.

    Raises WireFormatError (unreadable: HTTP 400) or InvalidInputError (readable, but naming a
    tensor outside `allowed`: HTTP 422). The metadata's keys are `parse_options`'s to check.
    """
    n = body.numel()
    prefix = bytes(body[:8].tolist()) if n >= 8 else b""
    hlen = header_length(prefix, n)
    try:
        header = json.loads(body[8 : 8 + hlen].numpy().tobytes(), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireFormatError("header", "JSON", f"invalid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise WireFormatError("header", "a JSON object", type(header).__name__)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) and len(v) <= MAX_METADATA_VALUE for v in metadata.values()
    ):
        raise WireFormatError(
            "__metadata__", f"an object of strings (each <= {MAX_METADATA_VALUE} chars)", "other"
        )
    extra = set(header) - allowed
    if extra:
        raise InvalidInputError(
            "body", f"tensors named among {', '.join(sorted(allowed))}", f"{sorted(extra)[:5]}"
        )
    start, data_bytes = 8 + hlen, n - 8 - hlen
    entries = sorted((_entry(k, v, data_bytes) for k, v in header.items()), key=lambda e: e.begin)
    for before, after in itertools.pairwise(entries):
        if after.begin < before.end:
            raise WireFormatError(after.name, f"data after {before.name}'s", "overlapping bytes")
    tensors = {}
    for e in entries:
        raw = body[start + e.begin : start + e.end]
        if (start + e.begin) % e.dtype.itemsize:
            raw = raw.clone()  # misaligned for its dtype (not as safetensors writes): one copy
        tensors[e.name] = raw.view(e.dtype).view(e.shape)
    return tensors, {str(k): v for k, v in metadata.items()}


@dataclass(frozen=True, slots=True)
class PrefillOptions:
    causal: bool = True
    return_lse: bool = False
    scale: float | None = None
    kernel: str = "auto"
    request_id: str | None = None
    # a request over the latent cache: how it is attended, in what precision, and the
    # registered w_kv_b it names
    form: str = "auto"
    weight: str | None = None
    precision: str = "auto"


def _flag(meta: Mapping[str, str], key: str, default: bool) -> bool:
    value = meta.get(key)
    if value is None:
        return default
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise InvalidInputError(f"__metadata__.{key}", '"true" or "false"', repr(value))


def check_request_id(name: str, request_id: str | None) -> None:
    """A request id is echoed and logged: at most MAX_REQUEST_ID printable characters."""
    if request_id is not None and not (
        len(request_id) <= MAX_REQUEST_ID and request_id.isprintable()
    ):
        raise InvalidInputError(
            name, f"<= {MAX_REQUEST_ID} printable characters", f"{len(request_id)} characters"
        )


def check_weight_name(where: str, name: object) -> str:
    """`name` where it is a weight's name (`WEIGHT_NAME`); InvalidInputError naming `where`."""
    if not isinstance(name, str) or WEIGHT_NAME.fullmatch(name) is None:
        given = repr(name)[:80] if isinstance(name, str) else type(name).__name__
        raise InvalidInputError(where, "1-128 characters of A-Z a-z 0-9 . _ -", given)
    return name


def parse_options(meta: Mapping[str, str], *, latent: bool = False) -> PrefillOptions:
    """The request's `__metadata__` as options; unknown keys are errors (typos fail loudly).
    `latent`: a form that takes requests over the latent cache (`LATENT_METADATA` too)."""
    known = REQUEST_METADATA | (LATENT_METADATA if latent else frozenset())
    extra = set(meta) - known
    if extra:
        raise InvalidInputError(
            "__metadata__", f"keys among {', '.join(sorted(known))}", f"{sorted(extra)}"
        )
    scale = None
    if "scale" in meta:
        try:
            scale = float(meta["scale"])
        except ValueError:
            raise InvalidInputError(
                "__metadata__.scale", "a decimal number", repr(meta["scale"])
            ) from None
    request_id = meta.get("request_id")
    check_request_id("__metadata__.request_id", request_id)
    weight = meta.get("weight")
    if weight is not None:
        check_weight_name("__metadata__.weight", weight)
    return PrefillOptions(
        causal=_flag(meta, "causal", True),
        return_lse=_flag(meta, "return_lse", False),
        scale=scale,
        kernel=meta.get("kernel", "auto"),
        request_id=request_id,
        form=meta.get("form", "auto"),
        weight=weight,
        precision=meta.get("precision", "auto"),
    )


def options_metadata(
    *,
    causal: bool,
    return_lse: bool,
    scale: float | None,
    kernel: str = "auto",
    request_id: str | None = None,
    form: str | None = None,
    weight: str | None = None,
    precision: str | None = None,
) -> dict[str, str]:
    meta = {"causal": str(causal).lower(), "return_lse": str(return_lse).lower(), "kernel": kernel}
    if scale is not None:
        meta["scale"] = repr(float(scale))
    if request_id is not None:
        meta["request_id"] = request_id
    if form is not None:
        meta["form"] = form
    if weight is not None:
        meta["weight"] = weight
    if precision is not None:
        meta["precision"] = precision
    return meta


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """`t`'s bytes, row-major; for a contiguous CPU tensor a view of its storage, no copy."""
    flat = (t if t.is_contiguous() else copied(t)).reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy().data)


def encode(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[memoryview]]:
    """The safetensors header (length prefix included) and each tensor's bytes, in order.

    Contiguous CPU tensors are not copied: their memoryviews point at the tensors' storage.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    chunks, offset = [], 0
    # larger elements first keeps every tensor aligned to its element size (as safetensors does)
    for name, t in sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0])):
        data = tensor_bytes(t)
        header[name] = {
            "dtype": BY_TORCH[t.dtype].safetensors,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        chunks.append(data)
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, chunks
