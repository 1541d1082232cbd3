"""Which attention kernels a call really ran, as torch's profiler saw the operators: evidence
independent of zen_mla's own report of its choice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import zen_mla

#: the operator each kernel name of zen_mla runs
KERNEL_OPS = {
    "zentorch": "zentorch::zentorch_sdpa",
    "torch": "aten::_scaled_dot_product_flash_attention_for_cpu",
    "native": "zen_mla::native_attend",
}


def kernels_ran(fn: Callable[[], Any]) -> tuple[Any, set[str]]:
    """`fn()`'s result and the kernel names (keys of KERNEL_OPS) whose operator it called. The
    calibrations behind "auto" (which run kernels of their own, once per process) are made
    first."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for return_lse in (False, True):
            zen_mla.kernel_choice("auto", dtype, return_lse=return_lse)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    names = {event.name for event in prof.events()}
    return result, {kernel for kernel, op in KERNEL_OPS.items() if op in names}
