"""Which attention kernels a call really ran, as torch's profiler saw the operators: evidence
independent of zen_mla's own report of its choice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile

#: the operator each kernel name of zen_mla runs
KERNEL_OPS = {
    "zentorch": "zentorch::zentorch_sdpa",
    "torch": "aten::_scaled_dot_product_flash_attention_for_cpu",
    "native": "zen_mla::native_attend",
}


def kernels_ran(fn: Callable[[], Any]) -> tuple[Any, set[str]]:
    """`fn()`'s result and the kernel names (keys of KERNEL_OPS) whose operator it called."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    names = {event.name for event in prof.events()}
    return result, {kernel for kernel, op in KERNEL_OPS.items() if op in names}
