"""Which kernel runs: what this host offers (zentorch's presence and health, probed once per
process against fp32 / fp64 references, and the CPU facts), what "auto" resolves to, and the
kernels a request naming one gets. Each kernel judges the probed facts itself
(`AttentionKernel.unavailable_reason` and its kin); like vLLM's `selector.py`, selection stands
apart from what it selects, and walks the registered kernels in their order of preference.
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..errors import InvalidInputError, KernelUnavailableError
from .batch import random_batch
from .calibrate import Calibration, build_facts, calibrated, calibration_enabled
from .driver import attend
from .host import CpuFacts, HostFacts, cpu_facts
from .kernels import KERNELS, AttentionKernel, NativeKernel, ZentorchKernel
from .kernels.native import native_isa, native_unavailable
from .kernels.zentorch import zentorch_op

__all__ = [
    "KERNEL_NAMES",
    "HostStatus",
    "KernelChoice",
    "host_facts",
    "host_kernels",
    "host_status",
    "kernel_choice",
    "probe_host_facts",
    "probe_kernel",
    "probe_lse",
    "probe_op",
    "select_kernel",
    "zentorch_status",
]

KERNEL_NAMES = ("auto", *KERNELS)


def probe_op(op: Any) -> str | None:
    """Run the op once on a small causal case; None if it agrees with fp32 math, else why not."""
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
    return None


@functools.cache
def _zentorch_probe() -> tuple[bool, str | None, bool, str | None]:
    try:
        version: str | None = importlib.metadata.version("zentorch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    op = zentorch_op()
    if op is None:
        why = "zentorch is not installed" if version is None else "zentorch has no zentorch_sdpa"
        return version is not None, version, False, why
    failure = probe_op(op)
    return True, version, failure is None, failure


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 out `[Sq, H, Dv]` and lse `[H, Sq]` of one sequence, bottom-right causal."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    sq, sk = q.shape[0], k.shape[0]
    if causal:
        hidden = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        scores.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]))  # rows with no key: 0
    return torch.einsum("hqk,khd->qhd", probs, v.double()), lse


#: (Sq, Sk) per sequence and causal: every path of the driver, MLA-like Dv < Dqk. Causal:
#: the square triangle, prefix-cached `Sq < Sk` (the additive mask), `Sq > Sk` (rows that see
#: no key) and a sequence with no keys; non-causal: `Sq != Sk` both ways.
_LSE_PROBE_CASES = (
    (((40, 40), (7, 29), (9, 4), (3, 0)), True, torch.bfloat16),
    (((5, 11), (12, 6)), False, torch.bfloat16),
    (((40, 40), (7, 29)), True, torch.float32),
)

#: the native kernel's, besides: more than one query block and key block per sequence (128 x
#: 256), a last block of one key, empty and one-token sequences, MLA's head dims
_NATIVE_PROBE_CASES = (
    (((40, 40), (7, 29), (9, 4), (3, 0), (0, 5), (1, 1)), True, torch.bfloat16),
    (((5, 11), (12, 6), (70, 257)), False, torch.bfloat16),
    (((130, 300), (300, 130)), True, torch.bfloat16),
)


def probe_lse() -> str | None:
    """zentorch's LSE route against fp64 (`probe_kernel`)."""
    return probe_kernel(ZentorchKernel, _LSE_PROBE_CASES, (2, 48, 32), "zentorch_sdpa's LSE route")


def probe_kernel(
    kernel: type[AttentionKernel],
    cases: tuple[tuple[tuple[tuple[int, int], ...], bool, torch.dtype], ...],
    heads: tuple[int, int, int],
    what: str,
) -> str | None:
    """Run `kernel` with its LSE through the ragged driver on the probe cases against fp64;
    None when every LSE is within 1e-3 (and -inf exactly where a query sees no key) and every
    `out` within its dtype's rounding, else what went wrong."""
    gen = torch.Generator().manual_seed(0)
    for lens, causal, dtype in cases:
        q_lens, kv_lens = [sq for sq, _ in lens], [sk for _, sk in lens]
        batch = random_batch(q_lens, kv_lens, heads, dtype, causal=causal, gen=gen)
        q, k, v, q_cu, kv_cu = (
            batch.q,
            batch.k,
            batch.v,
            batch.q_cu_seq_lens,
            batch.kv_cu_seq_lens,
        )
        case = f"{dtype} {'causal' if causal else 'non-causal'} (Sq, Sk) = {list(lens)}"
        try:
            out, lse = attend(batch, kernel, return_lse=True)
        except Exception as exc:
            return f"{what} raised on {case}: {exc}"
        assert lse is not None
        for i in range(len(lens)):
            qs, ks = slice(q_cu[i], q_cu[i + 1]), slice(kv_cu[i], kv_cu[i + 1])
            want_out, want_lse = _reference(q[qs], k[ks], v[ks], causal=causal, scale=batch.scale)
            got_lse = lse[:, qs].double()
            blind = torch.isinf(want_lse)
            if not torch.equal(torch.isinf(got_lse) & (got_lse < 0), blind):
                return f"{what}'s LSE is not -inf exactly where no key is seen, {case}"
            lse_err = _max_error(got_lse[~blind], want_lse[~blind])
            out_err = _max_error(out[qs].double(), want_out)
            out_tol = 0.05 if dtype == torch.bfloat16 else 1e-4
            if not (lse_err < 1e-3 and out_err < out_tol):  # NaN fails too
                return (
                    f"{what} disagrees with fp64 on {case}: lse error "
                    f"{lse_err:.3g} (allowed 1e-3), out error {out_err:.3g} (allowed {out_tol})"
                )
    return None


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) if want.numel() else 0.0


@functools.cache
def _native_probe() -> str | None:
    return native_unavailable() or probe_kernel(
        NativeKernel, _NATIVE_PROBE_CASES, (2, 192, 128), "zen-mla's native kernel"
    )


def probe_host_facts() -> HostFacts:
    """What this host offers, probed now (~30 ms); `host_facts()` keeps the first answer."""
    installed, version, op_ok, failure = _zentorch_probe()
    return HostFacts(
        cpu=cpu_facts(),
        zentorch_installed=installed,
        zentorch_version=version,
        zentorch_failure=failure,
        zentorch_lse_failure=probe_lse() if op_ok else failure,
        native_failure=_native_probe(),
    )


@functools.cache
def host_facts() -> HostFacts:
    """What this host offers, probed once per process."""
    return probe_host_facts()


def _cannot_run(kernel: type[AttentionKernel], host: HostFacts, dtype: torch.dtype) -> str | None:
    """Why `kernel` cannot compute `dtype` inputs on `host`, or None where it can."""
    reason = kernel.unavailable_reason(host)
    if reason is None and dtype not in kernel.dtypes:
        takes = ", ".join(str(d) for d in kernel.dtypes)
        reason = f"it takes {takes} only ({dtype} would come at lower precision or not at all)"
    return reason


#: calibrations made in this process and their winners, by (kernels, dtype, return_lse)
_CALIBRATIONS: dict[
    tuple[tuple[str, ...], torch.dtype, bool], tuple[Calibration, type[AttentionKernel]]
] = {}


def _calibration(
    host: HostFacts, kernels: list[type[AttentionKernel]], dtype: torch.dtype, *, lse: bool
) -> tuple[Calibration, type[AttentionKernel]]:
    key = (tuple(k.name for k in kernels), dtype, lse)
    if key not in _CALIBRATIONS:
        calibration = calibrated(kernels, dtype, return_lse=lse, build=build_facts(host))
        _CALIBRATIONS[key] = (calibration, KERNELS[calibration.winner])
    return _CALIBRATIONS[key]


@dataclass(frozen=True, slots=True)
class _Auto:
    """What "auto" takes for a dtype (with or without an LSE), and why: the reasons the kernels
    before the first suitable one were passed over, and the chosen kernel's own."""

    kernel: type[AttentionKernel]
    why: tuple[str, ...]
    calibration: Calibration | None
    #: several kernels suited "auto" and calibration was off
    unmeasured: bool

    @property
    def reason(self) -> str:
        """`why`, then which kernel won the calibration and by how much (built when asked:
        a request's selection needs the kernel only)."""
        said = [*self.why]
        if self.calibration is not None:
            said.append(self.calibration.reason())
        if self.unmeasured:
            said.append("first in order of preference (ZEN_MLA_CALIBRATE is off)")
        return "; ".join(said)


def _auto(host: HostFacts, dtype: torch.dtype, *, lse: bool) -> _Auto:
    """Of the registered kernels that run on `host` for `dtype`, suit "auto" and, with `lse`,
    give a trusted LSE: the one the calibration measured fastest where there are several (and
    calibration is on), else the first."""
    passed_over: list[str] = []
    eligible: list[type[AttentionKernel]] = []
    for kernel in KERNELS.values():
        reason = (
            _cannot_run(kernel, host, dtype)
            or kernel.auto_unsuited_reason(host)
            or (kernel.lse_unavailable_reason(host) if lse else None)
        )
        if reason is None:
            eligible.append(kernel)
        elif not eligible:
            passed_over.append(reason)
    if not eligible:
        raise KernelUnavailableError(
            "kernel", f"a kernel that runs here (none does: {'; '.join(passed_over)})", "'auto'"
        )
    calibration, chosen = None, eligible[0]
    measure = len(eligible) > 1 and calibration_enabled()
    if measure:
        calibration, chosen = _calibration(host, eligible, dtype, lse=lse)
    own = chosen.lse_reason if lse else chosen.auto_reason
    unmeasured = len(eligible) > 1 and not measure
    return _Auto(chosen, (*passed_over, own), calibration, unmeasured)


@dataclass(frozen=True, slots=True)
class HostStatus:
    """zentorch on this host, probed once, and what "auto" resolves to.

    `sdpa_ok`: the op exists *and* ran correctly here; `sdpa_lse_ok`: besides, its LSE route
    passed the start-up probe (every driver path against fp64). `auto_kernel` is what
    `kernel="auto"` resolves to for bf16: of the registered kernels that run here and suit
    "auto" (native where it passed its probe, zentorch where its op works, torch's always), the
    one `calibration` measured fastest. `lse_kernel` is what computes out and lse for
    `kernel="auto", return_lse=True` on bf16: the same among those whose LSE is trusted here
    (native's and zentorch's where their probes passed, torch's flash kernel always), measured
    with the LSE (`lse_calibration`). The reasons say why: why each kernel before the first
    suitable one was passed over, the chosen kernel's own, then which won the calibration and
    by how much. A calibration is None where one kernel suits or calibration is off.
    `native_ok`: zen-mla's native kernel is built, runs on this CPU and passed its start-up
    probe; `native_reason` says why not where it did not (None where it did); `native_path` the
    path it takes here ("avx512", "avx2"; None where it cannot run).
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
    native_ok: bool
    native_reason: str | None
    native_path: str | None = None
    calibration: Calibration | None = None
    lse_calibration: Calibration | None = None

    def as_dict(self) -> dict[str, Any]:
        """`host_kernels()`'s form (JSON-ready): what "auto" takes for `out` and with an LSE
        (kernel, reason, calibration), native's and zentorch's state, the CPU."""
        return {
            "auto": {
                "out": _choice(self.auto_kernel, self.reason, self.calibration),
                "lse": _choice(self.lse_kernel, self.lse_reason, self.lse_calibration),
            },
            "native": self.native(),
            "zentorch": self.zentorch(),
            "cpu": asdict(self.cpu),
        }

    def native(self) -> dict[str, Any]:
        """The native kernel's part: `{"ok", "reason", "path"}`."""
        return {"ok": self.native_ok, "reason": self.native_reason, "path": self.native_path}

    def zentorch(self) -> dict[str, Any]:
        """zentorch's part: `{"installed", "version", "ops": {"zentorch_sdpa",
        "zentorch_sdpa_lse"}}` (an op is true where it ran correctly here)."""
        return {
            "installed": self.installed,
            "version": self.version,
            "ops": {"zentorch_sdpa": self.sdpa_ok, "zentorch_sdpa_lse": self.sdpa_lse_ok},
        }

    def as_zentorch_status(self) -> dict[str, Any]:
        """The deprecated `zentorch_status()` form: zentorch's part and the CPU at the top,
        "auto"'s choices as `auto_kernel`, `reason`, `lse_kernel`, `lse_reason`."""
        return {
            **self.zentorch(),
            "cpu": asdict(self.cpu),
            "auto_kernel": self.auto_kernel,
            "reason": self.reason,
            "lse_kernel": self.lse_kernel,
            "lse_reason": self.lse_reason,
            "native": self.native(),
            "calibration": {
                "out": self.calibration.as_dict() if self.calibration else None,
                "lse": self.lse_calibration.as_dict() if self.lse_calibration else None,
            },
        }


def _choice(kernel: str, reason: str, calibration: Calibration | None) -> dict[str, Any]:
    return {
        "kernel": kernel,
        "reason": reason,
        "calibration": calibration.as_dict() if calibration else None,
    }


def host_status() -> HostStatus:
    """What this host offers, probed once per process (`host_facts()`), and what "auto" makes
    of it."""
    host = host_facts()
    auto = _auto(host, torch.bfloat16, lse=False)
    lse = _auto(host, torch.bfloat16, lse=True)
    return HostStatus(
        installed=host.zentorch_installed,
        version=host.zentorch_version,
        sdpa_ok=host.zentorch_failure is None,
        sdpa_lse_ok=host.zentorch_failure is None and host.zentorch_lse_failure is None,
        cpu=host.cpu,
        auto_kernel=auto.kernel.name,
        reason=auto.reason,
        lse_kernel=lse.kernel.name,
        lse_reason=lse.reason,
        native_ok=host.native_failure is None,
        native_reason=host.native_failure,
        native_path=(native_isa() or None) if host.native_failure is None else None,
        calibration=auto.calibration,
        lse_calibration=lse.calibration,
    )


def host_kernels() -> dict[str, Any]:
    """The host's kernels, probed once: `{"auto": {"out": {"kernel", "reason", "calibration"},
    "lse": {...}}, "native": {"ok", "reason", "path"}, "zentorch": {"installed", "version", "ops":
    {"zentorch_sdpa", "zentorch_sdpa_lse"}}, "cpu": {...}}` (see `HostStatus`, its typed
    form)."""
    return host_status().as_dict()


def zentorch_status() -> dict[str, Any]:
    """Deprecated name of `host_kernels()`, in its earlier form (zentorch's keys at the top;
    "auto"'s choice as `auto_kernel`, `reason`, `lse_kernel`, `lse_reason`); removed in 0.3."""
    warnings.warn(
        "zen_mla.zentorch_status() is deprecated: use zen_mla.host_kernels() (the same facts; "
        "'auto_kernel' is ['auto']['out']['kernel'], 'lse_kernel' ['auto']['lse']['kernel'])",
        DeprecationWarning,
        stacklevel=2,
    )
    return host_status().as_zentorch_status()


def select_kernel(kernel: str, dtype: torch.dtype, *, return_lse: bool) -> type[AttentionKernel]:
    """The kernel that computes `out` (and `lse`) for a request naming `kernel`.

    "auto" takes, of the registered kernels that run here, suit "auto" and compute `dtype` at
    their own precision (with `return_lse`, also give a trusted LSE), the one the calibration
    measured fastest (`attention.calibrate`; the first where it is off). A named kernel that
    cannot run raises KernelUnavailableError with its reason. With `return_lse`, a named kernel
    whose LSE is not trusted here (zentorch where its probe failed) hands the whole batch
    (out and lse from one softmax, so they merge consistently) to the kernel "auto" would take
    for an LSE: torch's flash kernel.
    """
    if kernel not in KERNEL_NAMES:
        raise InvalidInputError("kernel", f"one of {', '.join(KERNEL_NAMES)}", repr(kernel))
    host = host_facts()
    if kernel == "auto":
        return _auto(host, dtype, lse=return_lse).kernel
    chosen = KERNELS[kernel]
    reason = _cannot_run(chosen, host, dtype)
    if reason is not None:
        raise KernelUnavailableError(
            "kernel",
            f"a kernel that runs here ({kernel!r} cannot: {reason})",
            repr(kernel),
            'Use kernel="auto" to take the best available one',
        )
    if return_lse and chosen.lse_unavailable_reason(host) is not None:
        return _auto(host, dtype, lse=True).kernel
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
