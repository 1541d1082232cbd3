"""zen-mla's native MLA prefill kernel (`native.cpp`, built at install): the whole ragged batch in
one call, Dqk and Dv apart (no padded V), bottom-right causal, fp32-accurate LSE."""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..batch import RaggedBatch
from ..host import HostFacts
from .base import TILE_QUERIES, AttentionKernel, KernelCall, round32

__all__ = [
    "BLOCK_KEYS",
    "BLOCK_QUERIES",
    "EXTENSION",
    "NativeKernel",
    "native_module",
    "native_unavailable",
]

#: queries of a work item (one sequence, one head): the rows of each brgemm call
BLOCK_QUERIES = 128
#: keys of a block: the columns of S = Q K^T and the depth of P V (a sequence's last block, and
#: the part of a block a causal diagonal shows, are narrower, rounded up to 32). 128 x 256 keeps
#: a thread's tiles (S, P, acc, a packed K and V block: ~420 KiB) in a Zen 4 / Zen 5 core's
#: 1 MiB L2. Measured on a Zen 4 (2 threads, paired) against 32, 64, 192 and 256 x 256 and
#: 64 and 128 x 128: 256 x 256 was 3 % faster on `long` and `chunk` but slower on `mixed`, and
#: leaves 16 threads a quarter of the items on `chunk`; 64 x 256 was 5-8 % slower on all three
BLOCK_KEYS = 256

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
    def work(cls, batch: RaggedBatch) -> int:
        # Dqk is padded to 32; a row computes up to 31 keys past its last (key blocks are whole
        # 32s) and, on a causal diagonal, the keys its block's last row sees.
        tq, h, dqk = batch.q.shape
        extra = 32 + (BLOCK_QUERIES if batch.causal else 0)
        return h * round32(dqk) * (batch.work() // (h * dqk) + tq * extra)

    @classmethod
    def workspace_bytes(cls, batch: RaggedBatch, return_lse: bool, threads: int) -> int:
        # q and k padded to Dqk 32 deep; K and V of every head packed, sequences 32 long; per
        # thread its tiles; `out` through a copy where it is not written directly.
        tq, h, dqk = batch.q.shape
        tk, dv = int(batch.k.shape[0]), batch.v_head_dim
        padded = (tq + tk) * h * round32(dqk) * 2 if dqk % 32 else 0
        keys = tk + 32 * batch.num_requests
        packed = h * keys * (round32(dqk) + round32(dv)) * 2
        tiles = threads * (
            TILE_QUERIES * (BLOCK_KEYS * 6 + (round32(dv) + 2) * 4)
            + 2 * BLOCK_KEYS * (round32(dqk) + round32(dv)) * 2
        )
        return padded + packed + tiles + tq * h * dv * 2

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
        # The kernel writes host memory, rows with unit stride; any other `out` takes the result
        # by a copy.
        direct = out.device.type == "cpu" and out.stride(-1) == 1
        dst = out if direct else torch.empty(out.shape, dtype=out.dtype)
        q, k = batch.q, batch.k
        extra = -q.shape[-1] % 32
        if extra:  # AMX's bf16 tiles take Dqk 32 deep: zero columns change no score
            q, k = F.pad(q, (0, extra)), F.pad(k, (0, extra))
        module.attend(
            q,
            k,
            batch.v,
            torch.tensor(batch.q_cu_seq_lens, dtype=torch.int64),
            torch.tensor(batch.kv_cu_seq_lens, dtype=torch.int64),
            batch.scale,
            batch.causal,
            dst,
            lse,
            BLOCK_QUERIES,
            BLOCK_KEYS,
        )
        if dst is not out:
            out.copy_(dst)
