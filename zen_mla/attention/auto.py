"""What "auto" takes on this host, and why: of the registered kernels, in their order of
preference, those that run here, suit "auto" and (with an LSE) give a trusted one; the one the
calibration measured fastest where there are several. Each kernel judges the probed facts itself
(`AttentionKernel.unavailable_reason` and its kin).

Below both users of it: `select.py` (the kernel a request gets) and `status.py` (what the host
reports), so the report does not depend on a request's selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KernelUnavailableError
from .calibrate import Calibration, build_facts, calibrated, calibration_enabled
from .host import HostFacts
from .kernels import KERNELS, AttentionKernel

__all__ = ["AutoChoice", "auto_choice", "cannot_run"]


def cannot_run(kernel: type[AttentionKernel], host: HostFacts, dtype: torch.dtype) -> str | None:
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
class AutoChoice:
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


def auto_choice(host: HostFacts, dtype: torch.dtype, *, lse: bool) -> AutoChoice:
    """Of the registered kernels that run on `host` for `dtype`, suit "auto" and, with `lse`,
    give a trusted LSE: the one the calibration measured fastest where there are several (and
    calibration is on), else the first."""
    passed_over: list[str] = []
    eligible: list[type[AttentionKernel]] = []
    for kernel in KERNELS.values():
        reason = (
            cannot_run(kernel, host, dtype)
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
    return AutoChoice(chosen, (*passed_over, own), calibration, unmeasured)
