"""The ragged-batch driver: a validated varlen batch through one kernel, sequence by sequence
(equal-shape neighbours as one strided call), bottom-right causal, V padded once; or, to a
kernel that takes whole batches (`ragged`), in one call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import RaggedBatch
from .kernels import AttentionKernel, CallShape, KernelCall
from .padding import padded

__all__ = ["MASK_BUDGET_BYTES", "attend", "workspace_bytes"]

#: bytes of one additive bottom-right mask block; larger masks are applied in query blocks
MASK_BUDGET_BYTES = 16 << 20


def _heads_first(t: torch.Tensor, start: int, count: int, seq: int) -> torch.Tensor:
    """`[count, H, seq, D]` strided view of rows `[start, start + count * seq)` of `[T, H, D]`."""
    return t[start : start + count * seq].view(count, seq, *t.shape[1:]).transpose(1, 2)


def _bottom_right_mask(rows: range, sq: int, sk: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[len(rows), sk]`: query i sees keys j <= i + sk - sq (flash-attn >= 2.1)."""
    hidden = torch.arange(sk)[None, :] > (torch.arange(rows.start, rows.stop) + (sk - sq))[:, None]
    return torch.zeros(len(rows), sk, dtype=dtype).masked_fill_(hidden, float("-inf"))


@dataclass(frozen=True, slots=True)
class _RunOutput:
    """Where a run's results go: out `[n, H, Sq, Dv]` and lse `[n, H, Sq]`, views of the
    batch's outputs."""

    out: torch.Tensor
    lse: torch.Tensor | None

    def put(self, rows: slice, o: torch.Tensor, lse: torch.Tensor | None) -> None:
        self.out[:, :, rows].copy_(o[..., : self.out.shape[-1]])  # drops V's padding
        if self.lse is not None and lse is not None:
            self.lse[:, :, rows].copy_(lse)

    def blind(self, rows: slice) -> None:
        """Queries that see no key: out 0, lse -inf."""
        self.out[:, :, rows].zero_()
        if self.lse is not None:
            self.lse[:, :, rows].fill_(float("-inf"))


def workspace_bytes(
    batch: RaggedBatch, kernel: type[AttentionKernel], *, return_lse: bool, threads: int
) -> int:
    """An upper bound of the bytes `attend` allocates over `batch` with `kernel` on `threads`
    threads, beyond its inputs, `out` and `lse`: V padded once where the kernel wants equal head
    dims, then the largest run's call with its mask block (calls run one at a time); or, for a
    `ragged` kernel, its own whole-batch bound."""
    if kernel.ragged:
        return kernel.workspace_bytes(batch, return_lse, threads)
    _, h, dqk = batch.q.shape
    dv, itemsize = batch.v_head_dim, batch.q.element_size()
    pad = kernel.needs_equal_head_dims and dv < dqk
    padded_v = int(batch.k.shape[0]) * h * dqk * itemsize if pad else 0
    largest = 0
    for run in batch.runs():
        if run.sq == 0 or run.sk == 0:
            continue
        shape = CallShape(
            run.count, h, run.sq, run.sk, dqk, dqk if pad else dv, itemsize, return_lse
        )
        # the additive mask block and the boolean one it is made from
        mask = 2 * MASK_BUDGET_BYTES if batch.causal and run.sq < run.sk else 0
        largest = max(largest, kernel.call_bytes(shape, threads) + mask)
    return padded_v + largest


def attend(
    batch: RaggedBatch,
    kernel: type[AttentionKernel],
    *,
    return_lse: bool,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `kernel` over a validated batch, writing into `out` `[Tq, H, Dv]` (v's dtype) and,
    with `return_lse`, `lse` `[H, Tq]` fp32; both are allocated when not given (the pool gives
    views into shared memory)."""
    tq, h, dqk = batch.q.shape
    dv = batch.v_head_dim
    if out is None:
        out = torch.empty(tq, h, dv, dtype=batch.v.dtype)
    if return_lse and lse is None:
        lse = torch.empty(h, tq, dtype=torch.float32)
    if kernel.ragged:
        kernel.forward_ragged(batch, out, lse if return_lse else None)
    elif kernel.needs_equal_head_dims and dv < dqk:
        # The fused kernels want Dv == Dqk: pad V once for the whole batch (one copy, Tk rows)
        # rather than once per sequence; the padded columns of `out` are never copied out.
        with padded(batch.v, dqk) as v:
            _attend_runs(batch, kernel, v, out, lse, return_lse)
    else:
        _attend_runs(batch, kernel, batch.v, out, lse, return_lse)
    return out, lse


def _attend_runs(
    batch: RaggedBatch,
    kernel: type[AttentionKernel],
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    return_lse: bool,
) -> None:
    h = batch.q.shape[1]
    for run in batch.runs():
        if run.sq == 0:
            continue
        out_r = _heads_first(out, run.q_start, run.count, run.sq)
        lse_r = (
            lse[:, run.q_start : run.q_start + run.count * run.sq]
            .view(h, run.count, run.sq)
            .transpose(0, 1)
            if lse is not None
            else None
        )

        dst = _RunOutput(out_r, lse_r)
        if run.sk == 0:
            dst.blind(slice(None))
            continue
        q_r = _heads_first(batch.q, run.q_start, run.count, run.sq)
        k_r = _heads_first(batch.k, run.kv_start, run.count, run.sk)
        v_r = _heads_first(v, run.kv_start, run.count, run.sk)

        def call(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            causal: bool,
            mask: torch.Tensor | None,
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            return kernel.forward(KernelCall(q, k, v, batch.scale, causal, mask, return_lse))

        if not batch.causal:
            dst.put(slice(None), *call(q_r, k_r, v_r, causal=False, mask=None))
        elif run.sq >= run.sk:
            # Bottom-right: the first Sq - Sk queries see nothing, the rest form the usual
            # triangle, which is the kernels' (top-left) is_causal on a square.
            first = run.sq - run.sk
            if first:
                dst.blind(slice(0, first))
            o, lo = call(q_r[:, :, first:], k_r, v_r, causal=True, mask=None)
            dst.put(slice(first, None), o, lo)
        else:
            # Prefix-cached (Sq < Sk): every query sees the Sk - Sq cached keys plus its own
            # triangle. No kernel aligns causal bottom-right, so pass an additive mask, a block
            # of queries at a time to bound its memory; keys past a block's last visible one
            # are left out of the call altogether.
            step = max(1, MASK_BUDGET_BYTES // (run.sk * q_r.element_size()))
            for a in range(0, run.sq, step):
                b = min(run.sq, a + step)
                seen = b + run.sk - run.sq
                mask = _bottom_right_mask(range(a, b), run.sq, run.sk, q_r.dtype)[:, :seen]
                o, lo = call(
                    q_r[:, :, a:b], k_r[:, :, :seen], v_r[:, :, :seen], causal=False, mask=mask
                )
                dst.put(slice(a, b), o, lo)
