"""The one dtype table: every dtype a tensor may have on any wire, by each wire's name for it.

safetensors (a `/prefill` body, the regions JSON) and the Open Inference Protocol (KServe v2)
name dtypes differently; `role` says what a request may use it for: `value` (q, k, v, out),
`index` (cu_seq_lens), or `other` (a safetensors file may hold it; no request tensor may).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "BY_KSERVE",
    "BY_SAFETENSORS",
    "BY_TORCH",
    "INDEX_DTYPES",
    "TABLE",
    "VALUE_DTYPES",
    "Dtype",
    "kserve_names",
    "safetensors_names",
]


@dataclass(frozen=True, slots=True)
class Dtype:
    torch: torch.dtype
    safetensors: str
    kserve: str | None  # None: not an Open Inference Protocol datatype of ours
    role: Literal["value", "index", "other"]


TABLE: tuple[Dtype, ...] = (
    Dtype(torch.bfloat16, "BF16", "BF16", "value"),
    Dtype(torch.float16, "F16", "FP16", "value"),
    Dtype(torch.float32, "F32", "FP32", "value"),
    Dtype(torch.int32, "I32", "INT32", "index"),
    Dtype(torch.int64, "I64", "INT64", "index"),
    Dtype(torch.float64, "F64", None, "other"),
    Dtype(torch.int16, "I16", None, "other"),
    Dtype(torch.int8, "I8", None, "other"),
    Dtype(torch.uint8, "U8", None, "other"),
    Dtype(torch.bool, "BOOL", None, "other"),
)
BY_TORCH = {d.torch: d for d in TABLE}
BY_SAFETENSORS = {d.safetensors: d for d in TABLE}
BY_KSERVE = {d.kserve: d for d in TABLE if d.kserve is not None}
#: what q, k and v may be (out is v's), and what cu_seq_lens may be
VALUE_DTYPES = tuple(d.torch for d in TABLE if d.role == "value")
INDEX_DTYPES = tuple(d.torch for d in TABLE if d.role == "index")


def safetensors_names(role: Literal["value", "index"]) -> tuple[str, ...]:
    return tuple(d.safetensors for d in TABLE if d.role == role)


def kserve_names(role: Literal["value", "index"]) -> tuple[str, ...]:
    return tuple(d.kserve for d in TABLE if d.role == role and d.kserve is not None)
