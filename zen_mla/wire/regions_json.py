"""A prefill request whose tensors lie in same-host regions: a small JSON body, no tensor bytes.

It reads like a safetensors header whose entries say where a tensor lies instead of carrying
it: each name maps to `{"region", "offset", "dtype", "shape"}` (a contiguous tensor `offset`
bytes into a registered region, dtype named as safetensors names it), and `__metadata__` holds
the same options as a `/prefill` body's. The request names `q`, `k`, `v`, `q_cu_seq_lens`
(optional `kv_cu_seq_lens`) and where `out` (and with `return_lse`, `lse`) are to be written;
the answer is the same form with `out`, `lse` and `__metadata__` (`kernel`, `lse_kernel`,
`request_id`).

    POST /prefill
    Content-Type: application/vnd.zen-mla.regions+json

    {"q": {"region": "h", "offset": 0, "dtype": "BF16", "shape": [4096, 16, 192]}, ...,
     "out": {"region": "h", "offset": 75497472, "dtype": "BF16", "shape": [4096, 16, 128]},
     "__metadata__": {"causal": "true"}}
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidInputError, WireFormatError
from .dtypes import BY_SAFETENSORS
from .safetensors import (
    LATENT_TENSORS,
    MAX_DIM,
    MAX_HEADER_BYTES,
    MAX_METADATA_VALUE,
    REQUEST_TENSORS,
    RESPONSE_TENSORS,
    viewable,
)

__all__ = [
    "MEDIA_TYPE",
    "RegionMessage",
    "TensorPlace",
    "decode",
    "encode",
]

MEDIA_TYPE = "application/vnd.zen-mla.regions+json"
_FIELDS = frozenset({"region", "offset", "dtype", "shape"})
_MAX_DIMS = 4
_MAX_HANDLE = 64


@dataclass(frozen=True, slots=True)
class TensorPlace:
    """A contiguous tensor `offset` bytes into region `region`; `dtype` as safetensors names
    it (any name `dtypes` has; a request's tensors are "BF16", "F16", "F32", "I32" or "I64")."""

    region: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = BY_SAFETENSORS[self.dtype].torch.itemsize
        for d in self.shape:
            n *= d
        return n

    def as_json(self) -> dict[str, object]:
        return {
            "region": self.region,
            "offset": self.offset,
            "dtype": self.dtype,
            "shape": list(self.shape),
        }


@dataclass(frozen=True, slots=True)
class RegionMessage:
    """A decoded request or answer: places by tensor name, and the metadata."""

    places: dict[str, TensorPlace]
    metadata: dict[str, str]


def encode(places: Mapping[str, TensorPlace], metadata: Mapping[str, str] | None = None) -> bytes:
    body: dict[str, object] = {name: p.as_json() for name, p in places.items()}
    if metadata:
        body["__metadata__"] = dict(metadata)
    return json.dumps(body, separators=(",", ":")).encode()


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise WireFormatError("body", "JSON without duplicate names", f"{key!r} twice")
        out[key] = value
    return out


def _whole(name: str, field: str, value: object) -> int:
    """A count of the client's: a whole number 0 <= value < MAX_DIM, as every wire caps one."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_DIM:
        raise InvalidInputError(f"{name}.{field}", "a whole number 0 <= n < 2^48", repr(value)[:40])
    return value


def _shape(name: str, shape: object) -> tuple[int, ...]:
    """At most `_MAX_DIMS` dims, each a count (`_whole`), `viewable`."""
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise InvalidInputError(
            f"{name}.shape", f"a list of <= {_MAX_DIMS} sizes", repr(shape)[:80]
        )
    dims = tuple(_whole(name, "shape", d) for d in shape)
    if not viewable(dims):
        raise InvalidInputError(
            f"{name}.shape",
            "fewer than 2^48 elements (a 0 dim counted as 1)",
            str(list(dims))[:80],
        )
    return dims


def _place(name: str, raw: object) -> TensorPlace:
    if not isinstance(raw, dict) or set(raw) != _FIELDS:
        raise InvalidInputError(
            name, 'an object with "region", "offset", "dtype" and "shape"', repr(raw)[:80]
        )
    region, dtype, shape = raw["region"], raw["dtype"], raw["shape"]
    if not isinstance(region, str) or not 0 < len(region) <= _MAX_HANDLE:
        raise InvalidInputError(f"{name}.region", "a region handle", repr(region)[:40])
    if dtype not in BY_SAFETENSORS:
        raise InvalidInputError(
            f"{name}.dtype", f"one of {', '.join(BY_SAFETENSORS)}", repr(dtype)[:40]
        )
    return TensorPlace(region, _whole(name, "offset", raw["offset"]), dtype, _shape(name, shape))


def decode(body: bytes, names: frozenset[str]) -> RegionMessage:
    """Places and metadata from a JSON body, every field checked; `names` are the tensor names
    allowed (a request's inputs and outputs, or an answer's outputs).

    An orchestrator sends the same body layer after layer (the same places, the same options),
    and reading one costs ~16 us of Python (a hook per object, every field checked): the last
    `DECODED_KEPT` bodies read are kept, by their bytes, and a body read again costs a lookup.
    A body is only ever read one way, so a kept answer is the answer; the dicts are copies."""
    if len(body) > MAX_HEADER_BYTES:
        raise WireFormatError("body", f"at most {MAX_HEADER_BYTES} bytes of JSON", f"{len(body)}")
    kept = _decoded(bytes(body), names)
    return RegionMessage(dict(kept.places), dict(kept.metadata))


#: bodies whose reading is kept (each at most MAX_HEADER_BYTES: 64 of them hold at most 4 MiB)
DECODED_KEPT = 64


@functools.lru_cache(maxsize=DECODED_KEPT)
def _decoded(body: bytes, names: frozenset[str]) -> RegionMessage:
    try:
        raw = json.loads(body, object_pairs_hook=_no_duplicates)
    except WireFormatError:
        raise
    except (ValueError, RecursionError) as exc:
        raise WireFormatError("body", "a JSON object", f"unreadable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise WireFormatError("body", "a JSON object", type(raw).__name__)
    metadata = raw.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and len(v) <= MAX_METADATA_VALUE
        for k, v in metadata.items()
    ):
        raise InvalidInputError("__metadata__", "an object of short strings", "other")
    unknown = set(raw) - names
    if unknown:
        raise InvalidInputError(
            "body", f"tensors among {', '.join(sorted(names))}", f"{sorted(unknown)[:5]}"
        )
    return RegionMessage({n: _place(n, p) for n, p in raw.items()}, dict(metadata))


#: what a request may name: its inputs (k and v, or MLA's latent kv_c and k_pe) and where its
#: outputs go
REQUEST_NAMES = REQUEST_TENSORS | LATENT_TENSORS | RESPONSE_TENSORS
