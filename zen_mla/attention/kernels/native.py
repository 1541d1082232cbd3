"""zen-mla's native MLA prefill kernel (`native.cpp`, built at install): the whole ragged batch in
one call, Dqk and Dv apart (V never padded to Dqk), bottom-right causal, fp32-accurate LSE."""

from __future__ import annotations

import functools
import importlib
import itertools
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch

from ..batch import SMALL_BATCH, RaggedBatch
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
#: the widest Dqk (and Dv) one brgemm call takes, as native.cpp's kChunk
_CHUNK = 256

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
        "zen-mla's native kernel passed the start-up probe against fp64 and the CPU is AMD Zen or "
        "has AMX, where bench/kernel.py measured it faster than zentorch_sdpa and torch's kernel"
    )
    lse_reason: ClassVar[str] = (
        "zen-mla's native kernel passed the start-up probe against fp64 (its LSE too)"
    )

    @classmethod
    def unavailable_reason(cls, host: HostFacts) -> str | None:
        return host.native_failure or None

    @classmethod
    def auto_unsuited_reason(cls, host: HostFacts) -> str | None:
        if host.cpu.zen or host.cpu.amx_bf16:
            return None
        return (
            f"zen-mla's native kernel works, but it was measured faster on AMD Zen and on CPUs "
            f"with AMX only, and the CPU is {host.cpu.vendor} without AMX (kernel='native' "
            f"forces it)"
        )

    @classmethod
    def lse_unavailable_reason(cls, host: HostFacts) -> str | None:
        return host.native_failure or None

    @classmethod
    def work(cls, batch: RaggedBatch) -> int:
        # Dqk is taken `_qk_depth` deep. Past the visible pairs, a row computes the packing of
        # its sequence's last key block (under 256 keys) and, on a causal diagonal, the keys its
        # block's last row sees (under 128 more); a sequence's last query block is rounded up
        # to 16, 32, 64 or 128 rows (under 64 more), each seeing at most its sequence's keys.
        tq, h, dqk = batch.q.shape
        columns = _plan(batch)[0]
        per_row = BLOCK_KEYS + (BLOCK_QUERIES if batch.causal else 0)
        pairs = batch.work() // (h * dqk) if h * dqk else 0
        return h * _qk_depth(dqk) * (pairs + 63 * columns + tq * per_row)

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

    @classmethod
    def workspace_bytes(cls, batch: RaggedBatch, return_lse: bool, threads: int) -> int:
        """An upper bound of the bytes one `forward_ragged` call over `batch` allocates beyond
        its inputs, `out` and `lse`, for an `out` in host memory (as the engine and the workers
        hand it; a device `out` costs one more host copy of its size). It counts:

        - the packed K and V, bf16: `ceil64(Dqk)` (past 256: a multiple of 256) plus
          `ceil64(Dv)` columns for each packed key (a sequence's keys in blocks of 256, its
          last block packed a power of two from 32 wide), for the heads of one group: all of
          them, or as many as max(`PACK_FLOOR_BYTES`, twice the bytes of k and v) holds, at
          least one. The buffer is kept for the next call (up to 256 MiB), which allocates
          none where the kept one is large enough: counted all the same;
        - each of `threads` threads' tiles, ~0.3 MiB at MLA's head dims: its queries (bf16,
          128 x the packed Dqk), scores (fp32, 128 x 256) and probabilities (bf16), the fp32
          accumulator (128 x `ceil64(Dv)`), running max and sum;
        - the plan: the sequences, key blocks and query blocks, and the two int64
          cu_seq_lens tensors.

        Nothing is padded outside the kernel (q, k and v are read in place). Not counted, as
        no one call's: the oneDNN kernels ATen caches per thread for the life of the process
        (at most 164 a thread, ~7 MiB, whatever the requests: native.cpp). `return_lse`
        changes nothing: `lse` is the caller's.
        """
        heads, dqk, dv = batch.num_heads, batch.qk_head_dim, batch.v_head_dim
        bm, bn = BLOCK_QUERIES, BLOCK_KEYS
        kq, nv = _qk_depth(dqk), _round_up(dv, 64)
        columns, blocks, units = _plan(batch)
        head_bytes = columns * (kq + nv) * 2
        group = heads if head_bytes == 0 else min(heads, max(1, _pack_budget(batch) // head_bytes))
        packed = _round_up(max(group * head_bytes, 1), 64)
        tiles = sum(
            _round_up(n, 64)
            for n in (bm * kq * 2, bm * bn * 4, bm * nv * 4, bm * 4, bm * 4, bm * bn * 2)
        )
        seqs = batch.num_requests
        # native.cpp's Seq and KeyBlock: 5 int64 each, Unit 7; cu_seq_lens: B + 1 int64 each
        plan = 40 * (seqs + blocks) + 56 * units + 2 * 8 * (seqs + 1)
        return packed + tiles * threads + plan


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _qk_depth(dqk: int) -> int:
    """Dqk as the kernel's brgemm calls take it (native.cpp's qk_depth)."""
    return _round_up(dqk, 64) if dqk <= _CHUNK else _round_up(dqk, _CHUNK)


def _pack_budget(batch: RaggedBatch) -> int:
    """The bytes the packed K and V of a call may take (`PACK_FLOOR_BYTES`)."""
    kv_bytes = batch.k.shape[0] * batch.num_heads * (batch.qk_head_dim + batch.v_head_dim) * 2
    return max(PACK_FLOOR_BYTES, 2 * kv_bytes)


def _plan(batch: RaggedBatch) -> tuple[int, int, int]:
    """(packed key columns of one head, key blocks, query blocks) of a call, as native.cpp
    plans it: keys in blocks of `BLOCK_KEYS`, a sequence's last block rounded up to a power of
    two from 32; queries in blocks of `BLOCK_QUERIES`. In Python for a few sequences, else in
    int64 tensor arithmetic."""
    bm, bn = BLOCK_QUERIES, BLOCK_KEYS
    qc, kc = batch.q_cu_seq_lens, batch.kv_cu_seq_lens
    if len(kc) <= SMALL_BATCH:
        sks = [b - a for a, b in itertools.pairwise(kc)]
        sqs = [b - a for a, b in itertools.pairwise(qc)]
        tails = [sk % bn for sk in sks]
        columns = sum(sk - t for sk, t in zip(sks, tails, strict=True)) + sum(
            _tail_width(t) for t in tails if t
        )
        return columns, sum(-(-sk // bn) for sk in sks), sum(-(-sq // bm) for sq in sqs)
    k = torch.tensor(kc, dtype=torch.int64)
    q = torch.tensor(qc, dtype=torch.int64)
    sk, sq = k[1:] - k[:-1], q[1:] - q[:-1]
    tail = sk % bn
    # a tail's width: the power of two from 32 that holds it (bn is 256: 32, 64, 128, 256)
    width = torch.full_like(tail, 32)
    while bool((width < tail).any()):
        width = torch.where(width < tail, width * 2, width)
    width = torch.where(tail > 0, torch.clamp(width, max=bn), 0)
    columns = int((sk - tail).sum() + width.sum())
    return columns, int(((sk + bn - 1) // bn).sum()), int(((sq + bm - 1) // bm).sum())


def _tail_width(n: int) -> int:
    """The packed width of a last key block of `n` keys (native.cpp's pow2_bucket)."""
    width = 32
    while width < n:
        width *= 2
    return min(width, BLOCK_KEYS)
