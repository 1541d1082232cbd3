"""What this host reports of its kernels: `HostStatus` (zentorch's and the native kernel's
state, the CPU, what "auto" takes with and without an LSE, and why), `host_kernels()` its
JSON-ready form, and `zentorch_status()`, that form's deprecated earlier name and shape."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import probes
from .auto import auto_choice
from .calibrate import Calibration
from .host import CpuFacts
from .kernels.native import native_isa

__all__ = ["HostStatus", "host_kernels", "host_status", "zentorch_status"]


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
    # read from the module, not imported by name: a stand-in for the facts (a test's host
    # without zentorch) set there reaches this report and the selection alike
    host = probes.host_facts()
    auto = auto_choice(host, torch.bfloat16, lse=False)
    lse = auto_choice(host, torch.bfloat16, lse=True)
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
