"""What this host offers: zentorch's presence and health, and the CPU facts that decide "auto".

Probed once per process: `zentorch_status()` is cached, so the kernel choice made from it is
made once too, never per call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import itertools
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


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 out `[Sq, H, Dv]` and lse `[H, Sq]` of one request, bottom-right causal."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    sq, sk = q.shape[0], k.shape[0]
    if causal:
        hidden = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        scores.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]))  # rows with no key: 0
    return torch.einsum("hqk,khd->qhd", probs, v.double()), lse


#: (Sq, Sk) per request and causal: every path of the driver, MLA-like Dv < Dqk. Causal:
#: the square triangle, prefix-cached `Sq < Sk` (the additive mask), `Sq > Sk` (rows that see
#: no key) and a request with no keys; non-causal: `Sq != Sk` both ways.
_LSE_PROBE_CASES = (
    (((40, 40), (7, 29), (9, 4), (3, 0)), True, torch.bfloat16),
    (((5, 11), (12, 6)), False, torch.bfloat16),
    (((40, 40), (7, 29)), True, torch.float32),
)


def _lse_probe() -> str:
    """Run zentorch's LSE route through the ragged driver on `_LSE_PROBE_CASES` against fp64;
    '' when every LSE is within 1e-3 (and -inf exactly where a query sees no key) and every
    `out` within its dtype's rounding, else what went wrong."""
    # The driver imports the kernels, which import this module: import it when first probed.
    from ._attention import attend
    from ._ragged import validate
    from .kernels.zentorch import ZentorchKernel

    gen = torch.Generator().manual_seed(0)
    heads, dqk, dv = 2, 48, 32
    for lens, causal, dtype in _LSE_PROBE_CASES:
        q_cu = torch.tensor([0, *itertools.accumulate(sq for sq, _ in lens)])
        kv_cu = torch.tensor([0, *itertools.accumulate(sk for _, sk in lens)])
        q = torch.randn(int(q_cu[-1]), heads, dqk, generator=gen).to(dtype)
        k = torch.randn(int(kv_cu[-1]), heads, dqk, generator=gen).to(dtype)
        v = torch.randn(int(kv_cu[-1]), heads, dv, generator=gen).to(dtype)
        batch = validate(q, k, v, q_cu, kv_cu, causal=causal, scale=None)
        case = f"{dtype} {'causal' if causal else 'non-causal'} (Sq, Sk) = {list(lens)}"
        try:
            out, lse = attend(batch, ZentorchKernel, return_lse=True)
        except Exception as exc:
            return f"zentorch_sdpa's LSE route raised on {case}: {exc}"
        assert lse is not None
        for i in range(len(lens)):
            qs = slice(int(q_cu[i]), int(q_cu[i + 1]))
            ks = slice(int(kv_cu[i]), int(kv_cu[i + 1]))
            want_out, want_lse = _reference(q[qs], k[ks], v[ks], causal=causal, scale=batch.scale)
            got_lse = lse[:, qs].double()
            blind = torch.isinf(want_lse)
            if not torch.equal(torch.isinf(got_lse) & (got_lse < 0), blind):
                return f"zentorch_sdpa's LSE is not -inf exactly where no key is seen, {case}"
            lse_err = _max_error(got_lse[~blind], want_lse[~blind])
            out_err = _max_error(out[qs].double(), want_out)
            out_tol = 0.05 if dtype == torch.bfloat16 else 1e-4
            if not (lse_err < 1e-3 and out_err < out_tol):  # NaN fails too
                return (
                    f"zentorch_sdpa's LSE route disagrees with fp64 on {case}: lse error "
                    f"{lse_err:.3g} (allowed 1e-3), out error {out_err:.3g} (allowed {out_tol})"
                )
    return ""


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) if want.numel() else 0.0


@functools.cache
def _zentorch_lse_probe() -> str:
    return _lse_probe()


def zentorch_status() -> dict[str, Any]:
    """zentorch on this host, probed once.

    Returns `{"installed": bool, "version": str | None, "ops": {"zentorch_sdpa": bool,
    "zentorch_sdpa_lse": bool}, "cpu": {...}, "auto_kernel": "zentorch" | "torch",
    "reason": str, "lse_kernel": "zentorch" | "torch", "lse_reason": str}`.

    `ops.zentorch_sdpa` is True only when the op exists *and* ran correctly here;
    `ops.zentorch_sdpa_lse` only when, besides, its LSE route passed the start-up probe (every
    driver path against fp64). `auto_kernel` is what `kernel="auto"` resolves to: zentorch
    where the op works and the CPU is a Zen part (the kernel is AMD's, tuned for Zen; vLLM
    gates it the same way), else torch. `lse_kernel` is what computes out and lse for
    `kernel="auto", return_lse=True` on bf16: zentorch where it is `auto_kernel` and its LSE
    passed the probe, else torch's flash kernel.
    """
    installed, version, op_ok, failure = _zentorch_probe()
    cpu = cpu_facts()
    if op_ok and cpu["zen"]:
        auto, reason = "zentorch", "zentorch_sdpa works and the CPU is AMD Zen"
    elif op_ok:
        auto, reason = "torch", f"zentorch_sdpa works, but the CPU is {cpu['vendor']}, not Zen"
    else:
        auto, reason = "torch", failure
    lse_failure = _zentorch_lse_probe() if op_ok else failure
    if auto == "zentorch" and not lse_failure:
        lse_kernel = "zentorch"
        lse_reason = "zentorch_sdpa's LSE route passed the start-up probe against fp64"
    elif auto == "zentorch":
        lse_kernel, lse_reason = "torch", lse_failure
    else:
        lse_kernel, lse_reason = "torch", reason
    return {
        "installed": installed,
        "version": version,
        "ops": {"zentorch_sdpa": op_ok, "zentorch_sdpa_lse": op_ok and not lse_failure},
        "cpu": dict(cpu),
        "auto_kernel": auto,
        "reason": reason,
        "lse_kernel": lse_kernel,
        "lse_reason": lse_reason,
    }
