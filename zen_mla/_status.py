"""What this host offers: zentorch's presence and health, and the CPU facts that decide "auto".

Probed once per process: `zentorch_status()` is cached, so the kernel choice made from it is
made once too, never per call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from pathlib import Path
from typing import Any

import torch

__all__ = ["cpu_facts", "zentorch_op", "zentorch_status"]

_CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def cpu_facts() -> dict[str, Any]:
    """Vendor, model and the ISA features the kernels care about, read from /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        text = _CPUINFO.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:  # the first CPU's block is enough: the host is homogeneous
                break
            continue
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    vendor = fields.get("vendor_id", "unknown")
    family = int(fields.get("cpu family", "0") or 0)
    return {
        "vendor": vendor,
        "model": fields.get("model name", "unknown"),
        "family": family,
        # Zen is AMD family 0x17 (Zen 1/2), 0x19 (Zen 3/4) and 0x1A (Zen 5).
        "zen": vendor == "AuthenticAMD" and family >= 0x17,
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
    }


def zentorch_op() -> Any | None:
    """`torch.ops.zentorch.zentorch_sdpa` after importing zentorch, or None where absent."""
    try:
        importlib.import_module("zentorch")
    except Exception:  # ImportError, or a wheel built for another torch failing to load
        return None
    namespace = getattr(torch.ops, "zentorch", None)
    return getattr(namespace, "zentorch_sdpa", None) if namespace is not None else None


def _probe(op: Any) -> str:
    """Run the op once on a small causal case; '' if it agrees with fp32 math, else why not."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=gen) for _ in range(3))
    scale = 32**-0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    scores.masked_fill_(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ v
    try:
        got, _ = op(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.0, True, scale=scale)
    except Exception as exc:
        return f"zentorch_sdpa raised on this CPU: {exc}"
    err = (got.float() - expected).abs().max().item()
    if not err < 0.05:  # bf16 inputs: ~1e-2 is normal, and NaN fails too
        return f"zentorch_sdpa disagrees with fp32 math on this CPU (max error {err:.3g})"
    return ""


@functools.cache
def _zentorch_probe() -> tuple[bool, str | None, bool, str]:
    try:
        version: str | None = importlib.metadata.version("zentorch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    op = zentorch_op()
    if op is None:
        why = "zentorch is not installed" if version is None else "zentorch has no zentorch_sdpa"
        return version is not None, version, False, why
    failure = _probe(op)
    return True, version, not failure, failure


def zentorch_status() -> dict[str, Any]:
    """zentorch on this host, probed once.

    Returns `{"installed": bool, "version": str | None, "ops": {"zentorch_sdpa": bool},
    "cpu": {...}, "auto_kernel": "zentorch" | "torch", "reason": str}`. `ops.zentorch_sdpa` is
    True only when the op exists *and* ran correctly here. `auto_kernel` is what
    `kernel="auto"` resolves to: zentorch where the op works and the CPU is a Zen part (the
    kernel is AMD's, tuned for Zen; vLLM gates it the same way), else torch.
    """
    installed, version, op_ok, failure = _zentorch_probe()
    cpu = cpu_facts()
    if op_ok and cpu["zen"]:
        auto, reason = "zentorch", "zentorch_sdpa works and the CPU is AMD Zen"
    elif op_ok:
        auto, reason = "torch", f"zentorch_sdpa works, but the CPU is {cpu['vendor']}, not Zen"
    else:
        auto, reason = "torch", failure
    return {
        "installed": installed,
        "version": version,
        "ops": {"zentorch_sdpa": op_ok},
        "cpu": dict(cpu),
        "auto_kernel": auto,
        "reason": reason,
    }
