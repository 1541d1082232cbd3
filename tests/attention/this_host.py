"""This host's facts as the tests see them, found without zen_mla's probes: the expectations of
the kernels' reasons and of "auto" are derived from these, so the suite holds on any host."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import torch
import torch.nn.functional as F


def cpu_is_zen() -> bool:
    """The first CPU in /proc/cpuinfo is AMD family 0x17 (Zen 1) or later."""
    text = Path("/proc/cpuinfo").read_text()
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.MULTILINE)
    family = re.search(r"^cpu family\s*:\s*(\d+)", text, re.MULTILINE)
    return bool(vendor and family and vendor[1] == "AuthenticAMD" and int(family[1]) >= 0x17)


def zentorch_runs() -> bool:
    """zentorch imports and its zentorch_sdpa agrees with torch's fp32 SDPA on a causal case."""
    try:
        importlib.import_module("zentorch")
        op = torch.ops.zentorch.zentorch_sdpa
    except Exception:  # absent, a wheel for another torch, or no such op
        return False
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 24, 64, generator=gen).bfloat16() for _ in range(3))
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    try:
        got, _ = op(q, k, v, 0.0, True, scale=64**-0.5)
    except Exception:
        return False
    return bool((got.float() - want).abs().max() < 0.05)


def native_runs() -> bool:
    """zen-mla's native extension imports, the CPU has AVX-512 BF16 or AVX2 and FMA
    (/proc/cpuinfo), and the extension agrees with torch's fp32 SDPA on a causal case with MLA's
    head dims."""
    flags = set(re.findall(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)[0].split())
    if not ("avx512_bf16" in flags or {"avx2", "fma"} <= flags):
        return False
    try:
        importlib.import_module("zen_mla.attention.kernels._native")  # torch.ops.zen_mla
    except ImportError:
        return False
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(70, 3, 192, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(70, 3, 128, generator=gen).bfloat16()
    out = torch.empty(70, 3, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 70])
    try:
        torch.ops.zen_mla.native_attend(q, k, v, cu, cu, 192**-0.5, True, out, None)
    except Exception:  # a micro-kernel oneDNN refuses on this CPU, say
        return False
    heads_first = [t.float().transpose(0, 1) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*heads_first, is_causal=True).transpose(0, 1)
    return bool((out.float() - want).abs().max() < 0.05)
