"""zen-mla's native MLA prefill kernel (`native.cpp`, built at install): the whole ragged batch in
one call, Dqk and Dv apart (V never padded to Dqk), bottom-right causal, fp32-accurate LSE."""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch

from ..batch import RaggedBatch
from ..host import HostFacts
from .base import AttentionKernel, KernelCall

__all__ = [
    "BLOCK_KEYS",
    "BLOCK_QUERIES",
    "EXTENSION",
    "PACK_FLOOR_BYTES",
    "NativeKernel",
    "native_module",
    "native_unavailable",
]

#: queries of a work item (one sequence, one head): the rows of each brgemm call
BLOCK_QUERIES = 128
#: keys of a block: the columns of S = Q K^T and the depth of P V (a sequence's last block is
#: packed a power of two from 32 wide, and a causal diagonal that shows no more than half a
#: block multiplies that half: native.cpp keeps its brgemm shapes few). 128 x 256 keeps
#: a thread's tiles (S, P, acc, a packed K and V block: ~420 KiB) in a Zen 4 / Zen 5 core's
#: 1 MiB L2. Measured on a Zen 4 (2 threads, paired) against 32, 64, 192 and 256 x 256 and
#: 64 and 128 x 128: 256 x 256 was 3 % faster on `long` and `chunk` but slower on `mixed`, and
#: leaves 16 threads a quarter of the items on `chunk`; 64 x 256 was 5-8 % slower on all three
BLOCK_KEYS = 256
#: the packed K and V of a call take at most twice the bytes of k and v, or this where that is
#: less (a whole head where one takes more): past it, heads are packed and attended a group at
#: a time. Padding makes a packed key of a tiny head cost many times its bytes (1 key of
#: Dqk = 2, Dv = 1 packs 32 keys of 64 + 64 columns); MLA's batches pack in one group.
PACK_FLOOR_BYTES = 32 << 20

#: the extension's module, built by setup.py from native.cpp
EXTENSION = "zen_mla.attention.kernels._native"
#: written by setup.py next to where the extension would be when it was not built, with why
_UNBUILT = Path(__file__).with_name("_native_unbuilt.txt")


def _load() -> ModuleType:
    return importlib.import_module(EXTENSION)


@functools.cache
def native_module() -> tuple[ModuleType | None, str]:
    """The built extension, or None and why it cannot run here ('' where it can)."""
    try:
        module = _load()
    except ImportError as exc:
        try:
            why = _UNBUILT.read_text().strip()
        except OSError:
            why = f"it was not built ({exc})"
        return None, f"zen-mla's native kernel is not available: {why}"
    if not module.cpu_supported():
        return None, "zen-mla's native kernel needs AVX-512 BF16, which this CPU lacks"
    return module, ""


def native_unavailable() -> str:
    """'' where the extension is built and the CPU runs it, else why not (no probe run)."""
    return native_module()[1]


class NativeKernel(AttentionKernel):
    """A flash loop over oneDNN's brgemm micro-kernels (AVX-512 BF16 on Zen 4 / Zen 5, AMX on
    Intel hosts that have it): the driver hands it the whole batch (`forward_ragged`), so the
    threads share every sequence, head and query block, largest first."""

    name: ClassVar[str] = "native"
    needs_equal_head_dims: ClassVar[bool] = False
    ragged: ClassVar[bool] = True
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16,)
    auto_reason: ClassVar[str] = (
        "zen-mla's native kernel passed the start-up probe against fp64 and the CPU is AMD Zen, "
        "where bench/kernel.py measured it faster than zentorch_sdpa"
    )
    lse_reason: ClassVar[str] = (
        "zen-mla's native kernel passed the start-up probe against fp64 (its LSE too)"
    )

    @classmethod
    def unavailable_reason(cls, host: HostFacts) -> str | None:
        return host.native_failure or None

    @classmethod
    def auto_unsuited_reason(cls, host: HostFacts) -> str | None:
        if host.cpu.zen:
            return None
        return (
            f"zen-mla's native kernel works, but it was measured faster on AMD Zen only and the "
            f"CPU is {host.cpu.vendor} (kernel='native' forces it)"
        )

    @classmethod
    def lse_unavailable_reason(cls, host: HostFacts) -> str | None:
        return host.native_failure or None

    @classmethod
    def forward(cls, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError("the native kernel takes whole batches: forward_ragged")

    @classmethod
    def forward_ragged(
        cls, batch: RaggedBatch, out: torch.Tensor, lse: torch.Tensor | None
    ) -> None:
        module, why = native_module()
        assert module is not None, why  # the selector hands it batches only where it runs
        if batch.q.shape[0] == 0:
            return
        # The kernel writes host memory, any strides; a device `out` takes the result by a copy.
        dst = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
        module.attend(
            batch.q,
            batch.k,
            batch.v,
            torch.tensor(batch.q_cu_seq_lens, dtype=torch.int64),
            torch.tensor(batch.kv_cu_seq_lens, dtype=torch.int64),
            batch.scale,
            batch.causal,
            dst,
            lse,
            BLOCK_QUERIES,
            BLOCK_KEYS,
            _pack_budget(batch),
        )
        if dst is not out:
            out.copy_(dst)


def _pack_budget(batch: RaggedBatch) -> int:
    """The bytes the packed K and V of a call may take (`PACK_FLOOR_BYTES`)."""
    kv_bytes = batch.k.shape[0] * batch.num_heads * (batch.qk_head_dim + batch.v_head_dim) * 2
    return max(PACK_FLOOR_BYTES, 2 * kv_bytes)
