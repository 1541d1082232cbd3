"""vLLM's MLA prefill computed in vLLM's own process by zen-mla's kernels: `compute_here`, which
the in-process mode (`ZEN_MLA_URL=local`) runs for every call and the service link for the calls
the service cannot take, and `LocalPrefiller`, the in-process mode's `Prefiller`.

    prefiller = LocalPrefiller(LocalSettings(kernel="auto"))
    out, lse = prefiller.prefill(q, k, v, q_cu, kv_cu, causal=False, return_lse=True, scale=s)
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor
from typing import Any

import torch

from ..attention.select import kernel_choice
from ..attention.status import host_status
from ..copying import copy_into
from ..wire import PrefillOptions
from .context import CheckedPrefiller, PrefillOutput, RaggedTensors, inline
from .settings import LocalSettings
from .stats import stats

__all__ = ["LocalPrefiller", "compute_here", "describe_kernel"]

logger = logging.getLogger("zen_mla.vllm")


def compute_here(
    tensors: RaggedTensors,
    options: PrefillOptions,
    kernel: str = "auto",
    out: torch.Tensor | None = None,
) -> PrefillOutput:
    """One call computed in this process with `zen_mla.ragged_attention` (on the CPU: tensors on
    another device go there and come back), its out copied into `out` where one is given. The
    caller's torch threads run it: in vLLM's worker, the cores vLLM bound it to."""
    from .. import ragged_attention  # torch's kernels load on first use

    device = tensors[0].device
    qc, kc, vc, q_cu, kv_cu = (t.cpu() if t is not None else None for t in tensors)
    assert qc is not None and kc is not None and vc is not None and q_cu is not None
    causal, scale = options.causal, options.scale
    lse: torch.Tensor | None = None
    if options.return_lse:
        result, lse = ragged_attention(
            qc, kc, vc, q_cu, kv_cu, causal=causal, return_lse=True, scale=scale, kernel=kernel
        )
    else:
        result = ragged_attention(
            qc, kc, vc, q_cu, kv_cu, causal=causal, scale=scale, kernel=kernel
        )
    result = result.to(device) if out is None else copy_into(out, result)
    return result if lse is None else (result, lse.to(device))


def describe_kernel(kernel: str) -> str:
    """Which kernels `kernel` runs for bf16 here, without and with the LSE, and why (for "auto":
    what the start-up probe found)."""
    plain, lse = kernel_choice(kernel).out, kernel_choice(kernel, return_lse=True).out
    said = f"kernel {plain}" if plain == lse else f"kernel {plain} ({lse} where an LSE is asked)"
    if kernel != "auto":
        return f"{said}, as ZEN_MLA_KERNEL names"
    return f"{said}, auto: {host_status().reason}"


class LocalPrefiller(CheckedPrefiller):
    """Every call computed here (`compute_here`) with `settings.kernel`; what it returns is
    `ragged_attention`'s, so `call` does not check it again. Counts its calls in
    `zen_mla.vllm.stats` (`local`). Says once per process which kernel runs."""

    _told = threading.Event()

    def __init__(self, settings: LocalSettings) -> None:
        self.settings = settings

    def prefill(self, *args: Any, out: torch.Tensor | None = None, **options: Any) -> PrefillOutput:
        """As `PrefillClient.prefill` (q, k, v, q_cu_seq_lens[, kv_cu_seq_lens], causal,
        return_lse, scale, and `out` to write into), computed here."""
        if not self._told.is_set():
            self._told.set()
            logger.info(
                "zen-mla: vLLM's MLA prefill is computed in this process by zen-mla's %s",
                describe_kernel(self.settings.kernel),
            )
        tensors: RaggedTensors = (*args, None)[:5]
        got = compute_here(tensors, PrefillOptions(**options), self.settings.kernel, out)
        stats.add(local=1)
        return got

    def executor(self) -> Executor:
        """What runs a step's pieces: the caller's thread, one after another (each piece takes
        all its cores)."""
        return inline()
