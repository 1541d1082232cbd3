"""What every attention kernel offers the ragged-batch driver."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..batch import RaggedBatch
from ..host import HostFacts

__all__ = ["TILE_KEYS", "TILE_QUERIES", "AttentionKernel", "CallShape", "KernelCall", "round32"]

#: rows and columns of the tiles a flash kernel holds per thread (torch's CPU flash attention
#: takes at most 256 queries by 512 keys; zentorch's tiles are no larger)
TILE_QUERIES, TILE_KEYS = 256, 512


def round32(n: int) -> int:
    """`n` rounded up to a multiple of 32: AMX's bf16 tiles are 32 deep, and the kernels that
    use them pack sequence lengths and head dims so."""
    return -(-n // 32) * 32


@dataclass(frozen=True, slots=True)
class CallShape:
    """The shape of one `forward` call: `n` sequences of `heads` heads, `sq` queries against
    `sk` keys, head dims `dqk` and `dv` (as the kernel gets them: V padded where it wants equal
    dims), elements of `itemsize` bytes, the LSE asked or not."""

    n: int
    heads: int
    sq: int
    sk: int
    dqk: int
    dv: int
    itemsize: int
    return_lse: bool

    @property
    def out_bytes(self) -> int:
        """The call's `out` `[n, H, Sq, Dv]` and, when asked, its fp32 `lse` `[n, H, Sq]`."""
        rows = self.n * self.heads * self.sq
        return rows * self.dv * self.itemsize + (rows * 4 if self.return_lse else 0)

    def flash_bytes(self, threads: int) -> int:
        """A flash kernel's call: its returns, K and V packed whole into tiles padded to 32
        (torch's does so where the CPU has AMX), and per thread one tile of fp32 scores, their
        low-precision copy and an fp32 accumulator."""
        packed = self.n * self.heads * round32(self.sk) * (round32(self.dqk) + round32(self.dv))
        tile = TILE_QUERIES * (TILE_KEYS * (4 + self.itemsize) + (round32(self.dv) + 2) * 4)
        return self.out_bytes + packed * self.itemsize + threads * tile


@dataclass(frozen=True, slots=True)
class KernelCall:
    """One kernel call over `n` equal-length sequences of a batch.

    q: `[n, H, Sq, D]`, k: `[n, H, Sk, D]`, v: `[n, H, Sk, Dv]` (any strides, unit last
    stride). `causal` is the top-left triangle and comes only with `Sq == Sk`; other masks come
    as `mask`, an additive `[Sq, Sk]` tensor of q's dtype (0 or -inf) that leaves every query at
    least one key. `return_lse` is asked only where the selector found the kernel's LSE
    fp32-accurate.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    causal: bool
    mask: torch.Tensor | None
    return_lse: bool


class AttentionKernel:
    """One dense attention kernel over a batch of equal-length sequences.

    Capabilities are class-level. Each kernel says from the host's facts, probed once per
    process, whether it can run here, whether "auto" may take it, and whether its LSE is
    trusted, each as None or the reason why not; the selector (`attention.auto`,
    `attention.select`) asks, so the driver never re-checks per call. The defaults
    fit a kernel that runs on every CPU.
    """

    name: ClassVar[str]
    #: wants `Dv == Dqk`: the driver pads V once per batch and slices the padding off `out`
    needs_equal_head_dims: ClassVar[bool]
    #: takes the whole ragged batch in one call (`forward_ragged`), bottom-right causal and
    #: rows that see no key included, rather than runs of equal-length sequences (`forward`)
    ragged: ClassVar[bool] = False
    #: input dtypes computed at their own precision
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16, torch.float32)
    #: why "auto" may take this kernel (the calibration says why it took it)
    auto_reason: ClassVar[str] = "it runs here"
    #: why the LSE comes from this kernel where it does
    lse_reason: ClassVar[str] = "its LSE is fp32-accurate on every CPU"

    @classmethod
    def unavailable_reason(cls, host: HostFacts) -> str | None:
        """Why this kernel cannot run on `host`, or None where it computes correctly there."""
        return None

    @classmethod
    def auto_unsuited_reason(cls, host: HostFacts) -> str | None:
        """Why "auto" passes this kernel over on `host`, where it runs, or None where "auto"
        may take it."""
        return None

    @classmethod
    def lse_unavailable_reason(cls, host: HostFacts) -> str | None:
        """Why this kernel's LSE is not trusted on `host`, where it runs, or None where it is
        fp32-accurate (within 1e-3 of fp64) there."""
        return None

    @classmethod
    def work(cls, batch: RaggedBatch) -> int:
        """Multiply-adds of the score matmul this kernel performs on `batch`, what a work cap
        counts: the visible pairs' `batch.work()`, unless the kernel computes padding too."""
        return batch.work()

    @classmethod
    def call_bytes(cls, shape: CallShape, threads: int) -> int:
        """An upper bound of the bytes one `forward` call of `shape` allocates on `threads`
        threads: its returns and what the kernel makes inside (copies, packing, per-thread
        tiles). The driver adds what it makes around the calls (`driver.workspace_bytes`)."""
        raise NotImplementedError

    @classmethod
    def workspace_bytes(cls, batch: RaggedBatch, return_lse: bool, threads: int) -> int:
        """A `ragged` kernel's upper bound of the bytes one `forward_ragged` call over `batch`
        allocates beyond its inputs, `out` and `lse`, on `threads` threads."""
        raise NotImplementedError

    @classmethod
    def forward(cls, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of `call`'s sequences: out `[n, H, Sq, Dv]` in q's dtype (any strides)
        and, when `call.return_lse`, lse `[n, H, Sq]` fp32."""
        raise NotImplementedError

    @classmethod
    def forward_ragged(
        cls, batch: RaggedBatch, out: torch.Tensor, lse: torch.Tensor | None
    ) -> None:
        """A `ragged` kernel's attention of the whole batch into `out` `[Tq, H, Dv]` and, when
        given, `lse` `[H, Tq]` fp32 (queries that see no key: out 0, lse -inf)."""
        raise NotImplementedError
