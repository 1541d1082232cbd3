"""Which kernel runs, decided once per process: what this host offers (zentorch's presence and
health, probed at start-up against fp32 / fp64 references, and the CPU facts), what "auto"
resolves to, and the kernels a request naming one gets. The kernels know nothing of this
module; like vLLM's `selector.py`, selection stands apart from what it selects.
"""

from __future__ import annotations

import functools
import importlib.metadata
import itertools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInputError, KernelUnavailableError
from .batch import validate
from .driver import attend
from .kernels import KERNELS, AttentionKernel, TorchFlashKernel, ZentorchKernel
from .kernels.zentorch import zentorch_op

__all__ = [
    "KERNEL_NAMES",
    "CpuFacts",
    "HostStatus",
    "KernelChoice",
    "cpu_facts",
    "host_status",
    "kernel_choice",
    "probe_host",
    "probe_lse",
    "probe_op",
    "select_kernel",
    "zentorch_status",
]

KERNEL_NAMES = ("auto", *KERNELS)
_CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class CpuFacts:
    """Vendor, model and the ISA features the kernels care about."""

    vendor: str
    model: str
    family: int
    zen: bool  # AMD family 0x17 (Zen 1/2), 0x19 (Zen 3/4) or 0x1A (Zen 5)
    avx512f: bool
    avx512_bf16: bool
    amx_bf16: bool


@functools.cache
def cpu_facts() -> CpuFacts:
    """This host's CPU, read from /proc/cpuinfo (the first CPU's block: the host is
    homogeneous)."""
    fields: dict[str, str] = {}
    try:
        text = _CPUINFO.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break
            continue
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    vendor = fields.get("vendor_id", "unknown")
    family = int(fields.get("cpu family", "0") or 0)
    return CpuFacts(
        vendor=vendor,
        model=fields.get("model name", "unknown"),
        family=family,
        zen=vendor == "AuthenticAMD" and family >= 0x17,
        avx512f="avx512f" in flags,
        avx512_bf16="avx512_bf16" in flags,
        amx_bf16="amx_bf16" in flags,
    )


def probe_op(op: Any) -> str:
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
    failure = probe_op(op)
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


def probe_lse() -> str:
    """Run zentorch's LSE route through the ragged driver on `_LSE_PROBE_CASES` against fp64;
    '' when every LSE is within 1e-3 (and -inf exactly where a query sees no key) and every
    `out` within its dtype's rounding, else what went wrong."""
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


@dataclass(frozen=True, slots=True)
class HostStatus:
    """zentorch on this host, probed once, and what "auto" resolves to.

    `sdpa_ok`: the op exists *and* ran correctly here; `sdpa_lse_ok`: besides, its LSE route
    passed the start-up probe (every driver path against fp64). `auto_kernel` is what
    `kernel="auto"` resolves to: zentorch where the op works and the CPU is a Zen part (the
    kernel is AMD's, tuned for Zen; vLLM gates it the same way), else torch. `lse_kernel` is
    what computes out and lse for `kernel="auto", return_lse=True` on bf16: zentorch where it is
    `auto_kernel` and its LSE passed the probe, else torch's flash kernel. The reasons say why.
    """

    installed: bool
    version: str | None
    sdpa_ok: bool
    sdpa_lse_ok: bool
    cpu: CpuFacts
    auto_kernel: str
    reason: str
    lse_kernel: str
    lse_reason: str

    def as_dict(self) -> dict[str, Any]:
        """The contract's `zentorch_status()` form (JSON-ready)."""
        return {
            "installed": self.installed,
            "version": self.version,
            "ops": {"zentorch_sdpa": self.sdpa_ok, "zentorch_sdpa_lse": self.sdpa_lse_ok},
            "cpu": asdict(self.cpu),
            "auto_kernel": self.auto_kernel,
            "reason": self.reason,
            "lse_kernel": self.lse_kernel,
            "lse_reason": self.lse_reason,
        }


def probe_host() -> HostStatus:
    """What this host offers, probed now (~20 ms); `host_status()` keeps the first answer."""
    installed, version, op_ok, failure = _zentorch_probe()
    cpu = cpu_facts()
    if op_ok and cpu.zen:
        auto, reason = "zentorch", "zentorch_sdpa works and the CPU is AMD Zen"
    elif op_ok:
        auto, reason = "torch", f"zentorch_sdpa works, but the CPU is {cpu.vendor}, not Zen"
    else:
        auto, reason = "torch", failure
    lse_failure = probe_lse() if op_ok else failure
    if auto == "zentorch" and not lse_failure:
        lse_kernel = "zentorch"
        lse_reason = "zentorch_sdpa's LSE route passed the start-up probe against fp64"
    elif auto == "zentorch":
        lse_kernel, lse_reason = "torch", lse_failure
    else:
        lse_kernel, lse_reason = "torch", reason
    return HostStatus(
        installed=installed,
        version=version,
        sdpa_ok=op_ok,
        sdpa_lse_ok=op_ok and not lse_failure,
        cpu=cpu,
        auto_kernel=auto,
        reason=reason,
        lse_kernel=lse_kernel,
        lse_reason=lse_reason,
    )


@functools.cache
def host_status() -> HostStatus:
    """What this host offers, probed once per process."""
    return probe_host()


def zentorch_status() -> dict[str, Any]:
    """zentorch on this host, probed once: `{"installed", "version", "ops": {"zentorch_sdpa",
    "zentorch_sdpa_lse"}, "cpu", "auto_kernel", "reason", "lse_kernel", "lse_reason"}` (see
    `HostStatus`, its typed form)."""
    return host_status().as_dict()


def _unavailable_reason(kernel: type[AttentionKernel]) -> str:
    """'' where `kernel` can run on this host, else why not."""
    if kernel is ZentorchKernel:
        status = host_status()
        return "" if status.sdpa_ok else status.reason
    return ""


def _lse_unavailable_reason(kernel: type[AttentionKernel]) -> str:
    """'' where `kernel` gives an fp32-accurate LSE (within 1e-3 of fp64) here, else why not."""
    if kernel is ZentorchKernel:
        status = host_status()
        return "" if status.sdpa_lse_ok else status.lse_reason
    return ""


def select_kernel(kernel: str, dtype: torch.dtype, *, return_lse: bool) -> type[AttentionKernel]:
    """The kernel that computes `out` (and `lse`) for a request naming `kernel`.

    "auto" follows `host_status().auto_kernel`, falling back to torch for a dtype the chosen
    kernel would compute at lower precision. With `return_lse`, a kernel whose LSE is not
    fp32-accurate here (zentorch where its probe failed) hands the whole request (out and lse
    from one softmax, so they merge consistently) to torch's flash kernel.
    """
    if kernel not in KERNEL_NAMES:
        raise InvalidInputError("kernel", f"one of {', '.join(KERNEL_NAMES)}", repr(kernel))
    name = host_status().auto_kernel if kernel == "auto" else kernel
    chosen = KERNELS[name]
    if kernel == "auto" and dtype not in chosen.dtypes:
        chosen = TorchFlashKernel
    reason = _unavailable_reason(chosen)
    if not reason and dtype not in chosen.dtypes:
        reason = f"it computes {dtype} at lower precision"
    if reason:
        raise KernelUnavailableError(
            "kernel",
            f"a kernel that runs here ({kernel!r} cannot: {reason})",
            repr(kernel),
            'Use kernel="auto" to take the best available one',
        )
    if return_lse and _lse_unavailable_reason(chosen):
        return TorchFlashKernel
    return chosen


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """What computes a request's `out` and, when asked, its `lse` (None when not asked)."""

    out: str
    lse: str | None


def kernel_choice(
    kernel: str = "auto", dtype: torch.dtype = torch.bfloat16, *, return_lse: bool = False
) -> KernelChoice:
    """The kernels `ragged_attention(..., kernel=kernel, return_lse=return_lse)` runs for
    inputs of `dtype` on this host; raises as `ragged_attention` would."""
    chosen = select_kernel(kernel, dtype, return_lse=return_lse)
    return KernelChoice(chosen.name, chosen.name if return_lse else None)
