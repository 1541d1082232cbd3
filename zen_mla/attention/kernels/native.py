"""zen-mla's native MLA prefill kernel (`native.cpp`, built at install): the whole ragged batch in
one call, Dqk and Dv apart (V never padded to Dqk), bottom-right causal, fp32-accurate LSE.

The kernel is the torch operator `torch.ops.zen_mla.native_attend` (`OPERATOR`), registered by
importing the extension; its fake kernel (shapes without data, for torch.compile and
FakeTensorMode) is registered here, as the extension loads. It has a path per ISA (`PATHS`):
`avx512` (AVX-512 BF16, and AMX where the CPU has it: bf16 products) and `avx2` (AVX2 and FMA:
fp32 products, for CPUs without bf16 arithmetic such as EPYC Zen 2 and Zen 3); it takes the
best this CPU runs, or the one `ZEN_MLA_NATIVE_ISA` names (`native_isa()`)."""

from __future__ import annotations

import functools
import importlib
import itertools
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch

from ...envs import ZEN_MLA_NATIVE_ISA
from ..batch import SMALL_BATCH, RaggedBatch
from ..host import HostFacts, cpu_facts
from .base import AttentionKernel, KernelCall

__all__ = [
    "AMX_BLOCKS",
    "AVX2_BLOCKS",
    "EXTENSION",
    "ISA_VARIABLE",
    "OPERATOR",
    "PACK_FLOOR_BYTES",
    "PATHS",
    "ZEN_BLOCKS",
    "NativeKernel",
    "blocks",
    "native_isa",
    "native_module",
    "native_unavailable",
]

#: (queries, keys) of a block: a work item's queries (the rows of each brgemm call) and a key
#: block's keys (the columns of S = Q K^T and the depth of P V; a sequence's last block is
#: packed a power of two from 32 wide, and a causal diagonal that shows no more than half a
#: block multiplies that half: native.cpp keeps its brgemm shapes few). Without AMX (Zen 4 /
#: Zen 5), 128 x 256 keeps a thread's tiles (S, P, acc, a packed K and V block: ~420 KiB) in a
#: core's 1 MiB L2: measured on a Zen 4 (2 threads, paired) against 32, 64, 192 and 256 x 256
#: and 64 and 128 x 128, 256 x 256 was 3 % faster on `long` and `chunk` but slower on `mixed`,
#: and 64 x 256 5-8 % slower on all three.
ZEN_BLOCKS = (128, 256)
#: With AMX (Sapphire Rapids and later: 2 MiB of L2 a core), 256 x 512 (~1.1 MiB of tiles):
#: measured on a Xeon with AMX (2 threads, paired, 9 reps) against 128 x 256: 0.89x the time on
#: `long`, 0.97x `mixed`, 0.96x `short`, 0.94x `chunk` (256 x 256: 0.94 / 0.98 / 0.96 / 0.96;
#: 512 x 256: 0.96 / 1.03 / 0.98 / 0.97).
AMX_BLOCKS = (256, 512)
#: On the AVX2 path (fp32 tiles: twice a bf16 tile's bytes), 128 x 256: measured with the path
#: forced on an AMD EPYC Zen 5 (oneDNN held to AVX2, 2 threads, paired) against 64 x 256,
#: 64 x 128 and 32 x 256, it was the fastest on `long`, `mixed` and `chunk` and level on `short`.
AVX2_BLOCKS = (128, 256)
#: the kernel's paths, best first, as the operator's `isa` and `ZEN_MLA_NATIVE_ISA` name them:
#: AVX-512 BF16 (bf16 products; AMX tiles where the CPU has AMX), AVX2 with FMA (fp32 products)
PATHS = ("avx512", "avx2")
#: the environment variable that makes the kernel take one path (`PATHS`; `auto`, the default:
#: the best this CPU runs), e.g. to run and measure the AVX2 path on an AVX-512 host
ISA_VARIABLE = ZEN_MLA_NATIVE_ISA.name
#: the packed K and V of a call take at most twice the bytes of k and v on the AVX-512 path (once
#: them on the AVX2 path, whose fp32 packing takes twice bf16's), or this where that is less (a
#: whole head where one takes more): past it, heads are packed and attended a group at a time.
#: Padding makes a packed key of a tiny head cost many times its bytes (1 key of Dqk = 2,
#: Dv = 1 packs 32 keys of 64 + 64 columns); MLA's batches pack in one group on the AVX-512
#: path and in two on the AVX2 path.
PACK_FLOOR_BYTES = 32 << 20
#: the widest Dqk (and Dv) one brgemm call takes, as native.cpp's kChunk
_CHUNK = 256

#: keys a packed key block's width is a whole number of (its AMX tiles' depth), as native.cpp's
#: kTile: a sequence's last block is packed a power of two from it
_TILE = 32

#: the extension's module, built by setup.py from native.cpp
EXTENSION = "zen_mla.attention.kernels._native"
#: the operator the extension registers (`torch.ops.zen_mla.native_attend`): it writes `out`
#: and `lse` (and `parts`) and returns nothing
OPERATOR = "zen_mla::native_attend"
#: written by setup.py next to where the extension would be when it was not built, with why
_UNBUILT = Path(__file__).with_name("_native_unbuilt.txt")


def _load() -> ModuleType:
    """The extension's module, imported (which registers `OPERATOR`), with the operator's fake
    kernel registered."""
    module = importlib.import_module(EXTENSION)
    _register_fake()
    return module


def _fake_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    bm: int = 128,
    bn: int = 256,
    max_pack_bytes: int = 0,
    parts: torch.Tensor | None = None,
    isa: str = "auto",
) -> None:
    """`OPERATOR` without data: q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] bf16,
    q_cu_seq_lens and kv_cu_seq_lens [B + 1] int64; it writes out [Tq, H, Dv] bf16, lse
    [H, Tq] fp32 and parts [8] float64 where given, and returns nothing, so nothing here
    has a shape to compute."""


@functools.cache
def _register_fake() -> None:
    """Registers `_fake_attend` as `OPERATOR`'s fake kernel (and its Meta kernel), once; the
    operator must exist (the extension imported)."""
    torch.library.register_fake(OPERATOR)(_fake_attend)


@functools.cache
def native_module() -> tuple[ModuleType | None, str | None]:
    """The built extension and None, or None and why it cannot run here (not built, the CPU
    runs no path, or not the one `ZEN_MLA_NATIVE_ISA` names)."""
    try:
        module = _load()
    except ImportError as exc:
        try:
            why = _UNBUILT.read_text().strip()
        except OSError:
            why = f"it was not built ({exc})"
        return None, f"zen-mla's native kernel is not available: {why}"
    paths = module.cpu_paths()
    wanted = ZEN_MLA_NATIVE_ISA.read()
    if wanted not in ("auto", *PATHS):
        return None, (
            f"{ISA_VARIABLE} must be auto, {' or '.join(PATHS)}, not {wanted!r}: zen-mla's "
            "native kernel is off"
        )
    if not paths:
        return (
            None,
            "zen-mla's native kernel needs AVX-512 BF16 or AVX2 with FMA, which this CPU lacks",
        )
    if wanted != "auto" and wanted not in paths:
        return None, (
            f"zen-mla's native kernel: {ISA_VARIABLE}={wanted}, a path this CPU lacks "
            f"({_NEEDS[wanted]}); it runs {', '.join(paths)}"
        )
    return module, None


#: what each path needs of the CPU, in words
_NEEDS = {"avx512": "AVX-512 BF16", "avx2": "AVX2 with FMA"}


@functools.cache
def native_isa() -> str:
    """The path the kernel takes here (`PATHS`): the one `ZEN_MLA_NATIVE_ISA` names, else the
    best this CPU runs; "" where the kernel cannot run (`native_unavailable()` says why)."""
    module = native_module()[0]
    if module is None:
        return ""
    wanted = ZEN_MLA_NATIVE_ISA.read()
    return str(module.cpu_paths()[0]) if wanted == "auto" else wanted


def blocks() -> tuple[int, int]:
    """(queries, keys) of the kernel's blocks on this CPU and path: `AVX2_BLOCKS` on the AVX2
    path, else `AMX_BLOCKS` where the CPU has AMX, else `ZEN_BLOCKS`."""
    if native_isa() == "avx2":
        return AVX2_BLOCKS
    return AMX_BLOCKS if cpu_facts().amx_bf16 else ZEN_BLOCKS


def native_unavailable() -> str | None:
    """Why the extension cannot run here (not built, or the CPU cannot), None where it can (no
    probe run)."""
    return native_module()[1]


class NativeKernel(AttentionKernel):
    """A flash loop over oneDNN's brgemm micro-kernels (AVX-512 BF16 on Zen 4 / Zen 5, AMX on
    Intel hosts that have it, fp32 AVX2 FMA on Zen 2 / Zen 3): the driver hands it the whole
    batch (`forward_ragged`), so the threads share every sequence, head and query block,
    largest first."""

    name: ClassVar[str] = "native"
    needs_equal_head_dims: ClassVar[bool] = False
    ragged: ClassVar[bool] = True
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16,)
    auto_reason: ClassVar[str] = "zen-mla's native kernel passed the start-up probe against fp64"
    lse_reason: ClassVar[str] = (
        "zen-mla's native kernel passed the start-up probe against fp64 (its LSE too)"
    )

    @classmethod
    def unavailable_reason(cls, host: HostFacts) -> str | None:
        return host.native_failure

    @classmethod
    def lse_unavailable_reason(cls, host: HostFacts) -> str | None:
        return host.native_failure

    @classmethod
    def work(cls, batch: RaggedBatch) -> int:
        # Dqk is taken `_qk_depth` deep. Past the visible pairs, a row computes the packing of
        # its sequence's last key block (under a block of keys) and, on a causal diagonal, the
        # keys its block's last row sees (under a block of queries more); a sequence's last
        # query block is rounded up to a power of two from 16 rows (under half a block more),
        # each seeing at most its sequence's keys.
        tq, h, dqk = batch.q.shape
        columns = _plan(batch)[0]  # packed ahead or by the items: the same work
        bm, bn = blocks()
        per_row = bn + (bm if batch.causal else 0)
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
        torch.ops.zen_mla.native_attend(
            batch.q,
            batch.k,
            batch.v,
            torch.tensor(batch.q_cu_seq_lens, dtype=torch.int64),
            torch.tensor(batch.kv_cu_seq_lens, dtype=torch.int64),
            batch.scale,
            batch.causal,
            dst,
            lse,
            *blocks(),
            _pack_budget(batch),
            None,
            native_isa(),
        )
        if dst is not out:
            out.copy_(dst)

    @classmethod
    def workspace_bytes(cls, batch: RaggedBatch, return_lse: bool, threads: int) -> int:
        """An upper bound of the bytes one `forward_ragged` call over `batch` allocates beyond
        its inputs, `out` and `lse`, for an `out` in host memory (as the engine and the workers
        hand it; a device `out` costs one more host copy of its size). It counts:

        - the packed K and V, bf16 (fp32 on the AVX2 path): `ceil64(Dqk)` (past 256: a
          multiple of 256) plus
          `ceil64(Dv)` columns for each key packed ahead (a sequence's keys in blocks of
          `blocks()`, its last block packed a power of two from 32 wide; a sequence of one
          block of queries packs its own as it goes, in its items' tiles), for the heads of one
          group: all of them, or as many as max(`PACK_FLOOR_BYTES`, twice the bytes of k and
          v) holds (on the AVX2 path: the bytes of k and v), at least one. The buffer is kept
          for the next call (up to 256 MiB), which
          allocates none where the kept one is large enough: counted all the same;
        - each of `threads` threads' tiles, at MLA's head dims ~0.45 MiB (128 x 256 blocks) or
          ~1.3 MiB (256 x 512), ~0.75 MiB on the AVX2 path: its queries (bf16, bm x the packed
          Dqk), scores (fp32, bm x bn) and probabilities (bf16; on the AVX2 path fp32 over the
          scores), the fp32 accumulator (bm x `ceil64(Dv)`), running max and sum, and a packed
          K and V block (bn keys; fp32 on the AVX2 path). Each thread keeps its tiles for the next
          call (up to 8 MiB), which allocates none where they are large enough: counted all the
          same;
        - the plan: the sequences, key blocks, query blocks and packing slices, and the two
          int64 cu_seq_lens tensors.

        Nothing is padded outside the kernel (q, k and v are read in place). Not counted, as
        no one call's: the oneDNN kernels ATen caches per thread for the life of the process
        (at most 164 a thread with 128 x 256 blocks, ~7 MiB; 250 with 256 x 512, ~11 MiB;
        whatever the requests: native.cpp). `return_lse` changes nothing: `lse` is the
        caller's.
        """
        heads, dqk, dv = batch.num_heads, batch.qk_head_dim, batch.v_head_dim
        bm, bn = blocks()
        kq, nv = _qk_depth(dqk), _round_up(dv, 64)
        fp32 = native_isa() == "avx2"
        size = 4 if fp32 else 2  # a packed value, a query's and (apart from S) a probability's
        _, ahead, key_blocks, units = _plan(batch)
        head_bytes = ahead * (kq + nv) * size
        group = heads if head_bytes == 0 else min(heads, max(1, _pack_budget(batch) // head_bytes))
        packed = _round_up(max(group * head_bytes, 1), 64)
        tiles = sum(
            _round_up(n, 64)
            for n in (
                *(bm * kq * size, bm * bn * 4, bm * nv * 4, bm * 4, bm * 4),
                *(0 if fp32 else bm * bn * 2, bn * kq * size, bn * nv * size),
            )
        )
        seqs = batch.num_seqs
        # native.cpp's Seq: 6 words, KeyBlock 5, Unit 7, a packing slice 2 (one a block's 64
        # packed keys); cu_seq_lens: B + 1 int64 each
        slices = key_blocks + ahead // 64
        plan = 48 * seqs + 40 * key_blocks + 56 * units + 16 * slices + 2 * 8 * (seqs + 1)
        return packed + tiles * threads + plan


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _qk_depth(dqk: int) -> int:
    """Dqk as the kernel's brgemm calls take it (native.cpp's qk_depth)."""
    return _round_up(dqk, 64) if dqk <= _CHUNK else _round_up(dqk, _CHUNK)


def _pack_budget(batch: RaggedBatch) -> int:
    """The bytes the packed K and V of a call may take (`PACK_FLOOR_BYTES`)."""
    kv_bytes = batch.k.shape[0] * batch.num_heads * (batch.qk_head_dim + batch.v_head_dim) * 2
    return max(PACK_FLOOR_BYTES, (1 if native_isa() == "avx2" else 2) * kv_bytes)


def _plan(batch: RaggedBatch) -> tuple[int, int, int, int]:
    """(key columns of one head, of them those packed ahead, key blocks, query blocks) of a
    call, as native.cpp plans it: keys in blocks of `blocks()`'s keys, a sequence's last block
    rounded up to a power of two from 32; queries in blocks of its queries; a sequence of one
    block of queries packs its key blocks as its items reach them, not ahead. In Python for a
    few sequences, else in int64 tensor arithmetic."""
    bm, bn = blocks()
    qc, kc = batch.q_cu_seq_lens, batch.kv_cu_seq_lens
    if len(kc) <= SMALL_BATCH:
        sks = [b - a for a, b in itertools.pairwise(kc)]
        sqs = [b - a for a, b in itertools.pairwise(qc)]
        widths = [sk - sk % bn + (_tail_width(sk % bn) if sk % bn else 0) for sk in sks]
        ahead = sum(w for w, sq in zip(widths, sqs, strict=True) if sq > bm)
        blocks_ = sum(-(-sk // bn) for sk in sks)
        return sum(widths), ahead, blocks_, sum(-(-sq // bm) for sq in sqs)
    k = torch.tensor(kc, dtype=torch.int64)
    q = torch.tensor(qc, dtype=torch.int64)
    sk, sq = k[1:] - k[:-1], q[1:] - q[:-1]
    tail = sk % bn
    # a tail's width: the power of two from _TILE that holds it, at most bn
    width = torch.full_like(tail, _TILE)
    while bool((width < tail).any()):
        width = torch.where(width < tail, width * 2, width)
    width = sk - tail + torch.where(tail > 0, torch.clamp(width, max=bn), 0)
    ahead = int(torch.where(sq > bm, width, 0).sum())
    return (
        int(width.sum()),
        ahead,
        int(((sk + bn - 1) // bn).sum()),
        int(((sq + bm - 1) // bm).sum()),
    )


def _tail_width(n: int) -> int:
    """The packed width of a last key block of `n` keys (native.cpp's pow2_bucket)."""
    width = _TILE
    while width < n:
        width *= 2
    return min(width, blocks()[1])


# Where the extension was imported before this module (the operator defined): its fake kernel.
if hasattr(torch.ops.zen_mla, "native_attend"):
    _register_fake()
