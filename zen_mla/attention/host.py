"""This host as the kernels judge it: the CPU and what the start-up probes found (the probes
themselves run in `attention.probes`, which builds a `HostFacts` once per process)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuFacts", "HostFacts", "cpu_facts"]

_CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class CpuFacts:
    """Vendor, model and the ISA features the kernels care about."""

    vendor: str
    model: str
    family: int
    # AMD family 0x17 or later: Zen 1/2 are 0x17, Zen 3/4 0x19, Zen 5 0x1A; a later family is
    # taken for Zen too
    zen: bool
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


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What each kernel reads to say whether it can run here (`AttentionKernel`'s reasons).

    A failure is None where the probe passed, else why it did not, in words for an error
    message.
    """

    cpu: CpuFacts
    #: zentorch's distribution is installed, or zentorch imports and offers zentorch_sdpa
    zentorch_installed: bool
    #: the installed distribution's version, None where there is none
    zentorch_version: str | None
    #: zentorch_sdpa exists and agreed with fp32 math on a small causal case
    zentorch_failure: str | None
    #: besides, its LSE route agreed with fp64 on every path of the ragged driver
    zentorch_lse_failure: str | None
    #: zen-mla's native kernel is built, the CPU runs it, and its out and LSE agreed with fp64
    #: on every case of the start-up probe
    native_failure: str | None
