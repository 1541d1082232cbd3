"""The Open Inference Protocol's parameters as `mla_prefill` reads them: the request's (its
options, and the caller's deadline), a tensor's (binary data, system shared memory), each value
checked, each unknown name refused naming it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zen_mla import InvalidInputError
from zen_mla.deadline import timeout_of
from zen_mla.wire import check_weight_name

__all__ = [
    "PARAMETERS",
    "SHM_KEYS",
    "ShmPlace",
    "count",
    "flag",
    "kind",
    "request_parameters",
    "shm_place",
    "tensor_parameters",
]

#: the request's parameters
PARAMETERS = (
    "causal",
    "return_lse",
    "scale",
    "kernel",
    "binary_data_output",
    "timeout",
    "form",
    "precision",
    "weight",
)
#: a tensor's parameters that place it in system shared memory
SHM_KEYS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


@dataclass(frozen=True, slots=True)
class ShmPlace:
    """A tensor's bytes in a registered system shared memory region."""

    region: str
    offset: int
    byte_size: int


def kind(value: object) -> str:
    return "none" if value is None else type(value).__name__


def flag(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidInputError(name, "true or false", repr(value)[:40])


def count(name: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise InvalidInputError(name, "a whole number >= 0", repr(value)[:40])


def request_parameters(raw: object) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidInputError("parameters", "a JSON object", kind(raw))
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("causal", "return_lse", "binary_data_output"):
            out[key] = flag(key, value)
        elif key == "scale":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not (ok and math.isfinite(value) and value > 0):
                raise InvalidInputError("scale", "a finite number > 0", repr(value)[:40])
            out[key] = float(value)
        elif key in ("kernel", "form", "precision"):
            if not isinstance(value, str):
                raise InvalidInputError(key, "a string", kind(value))
            out[key] = value
        elif key == "weight":  # a registered w_kv_b, for a request over the latent cache
            out[key] = check_weight_name("parameters.weight", value)
        elif key == "timeout":
            # microseconds (tritonclient's `timeout=`; 0 for none): the caller's deadline, work
            # still queued at it is not computed (`zen_mla.deadline`)
            none = type(value) is int and value == 0
            out[key] = None if none else timeout_of(value, "timeout", 1e-6)
        else:
            raise InvalidInputError(
                "parameters", f"names among {', '.join(PARAMETERS)}", repr(key)[:60]
            )
    return out


def tensor_parameters(name: str, raw: object, binary_key: str) -> dict[str, Any]:
    """A tensor's `parameters`: `binary_key` and the shared-memory ones, no others."""
    params = raw or {}
    if not isinstance(params, dict):
        raise InvalidInputError(f"{name}.parameters", "a JSON object", kind(params))
    unknown = sorted(set(params) - {binary_key, *SHM_KEYS})
    if unknown:
        raise InvalidInputError(
            f"{name}.parameters",
            f"names among {binary_key}, " + ", ".join(SHM_KEYS),
            repr(unknown[0])[:60],
        )
    return params


def shm_place(name: str, params: Mapping[str, Any]) -> ShmPlace | None:
    given = [k for k in SHM_KEYS if k in params]
    if not given:
        return None
    region = params.get("shared_memory_region")
    if not isinstance(region, str):
        raise InvalidInputError(f"{name}.shared_memory_region", "a region name", kind(region))
    if "shared_memory_byte_size" not in params:
        raise InvalidInputError(f"{name}.shared_memory_byte_size", "a byte count", "none")
    return ShmPlace(
        region,
        count(f"{name}.shared_memory_offset", params.get("shared_memory_offset", 0)),
        count(f"{name}.shared_memory_byte_size", params["shared_memory_byte_size"]),
    )
