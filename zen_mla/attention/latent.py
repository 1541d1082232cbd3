"""MLA attention from the latent cache: `latent_attention` over a ragged batch whose keys and
values are a DeepSeek layer's cached latent `kv_c` and shared rope key `k_pe`, with the layer's
`kv_b_proj` weight, in one of two forms per sequence.

With R = kv_lora_rank (512), P = the rope dims (64), Dn = the no-rope query dims (128), Dv = the
value dims (128), Dqk = Dn + P, and M new tokens of a sequence, per key and head:

    expand  each key block's k_nope and v made from its latent block (all heads in one matmul)
            as the flash loop reaches it, then Dqk/Dv attention: 2 R (Dn + Dv) + 2 (Dqk + Dv) M
            = 262,144 + 640 M FLOP
    absorb  W_k folded into the queries and W_v into the output: attention of (R + P)-dim
            queries against the latent key [kv_c, k_pe] every head shares, (R)-dim values:
            2 (R + P) M + 2 R M = 2,176 M FLOP

Every product runs in fp32 on fp32 copies of the blocks (a bf16 `torch.matmul` is a scalar loop
on CPUs without bf16 arithmetic: 0.3 GFLOP/s on an EPYC Zen 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import torch

from ..errors import InvalidInputError
from .batch import check_offsets, check_scale, check_tensor

__all__ = [
    "CROSSOVER",
    "FORMS",
    "KEY_BLOCK",
    "SCORE_BUDGET_BYTES",
    "Form",
    "LatentBatch",
    "latent_attention",
    "validate_latent",
]

Form = Literal["expand", "absorb", "auto"]
FORMS: tuple[Form, ...] = ("expand", "absorb", "auto")

#: new tokens of a sequence from which "auto" expands rather than absorbs: where the cost model's
#: two figures (module docstring) meet for DeepSeek's dims, 262,144 / (2,176 - 640) = 170.7; not
#: yet calibrated against measured times
CROSSOVER = 170

#: keys a block of the flash loop takes: the expand form makes k_nope and v for this many at once
KEY_BLOCK = 256

#: fp32 scores of one block (queries x heads x keys); the query blocks are sized to it
SCORE_BUDGET_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class LatentBatch:
    """A validated varlen batch over the latent cache.

    q: `[Tq, H, Dqk]`; kv_c: `[Tk, R]`; k_pe: `[Tk, P]` with `P < Dqk`; w_kv_b:
    `[H * (Dn + Dv), R]` with `Dn = Dqk - P`, `Dv >= 1`, head h's rows `k_nope` then `v`; one dtype
    of bf16/fp16/fp32, on the CPU. `q_cu_seq_lens`/`kv_cu_seq_lens`: `B + 1` offsets as Python
    ints. `scale`: positive and finite.
    """

    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    w_kv_b: torch.Tensor
    q_cu_seq_lens: tuple[int, ...]
    kv_cu_seq_lens: tuple[int, ...]
    causal: bool
    scale: float

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[1])

    @property
    def kv_lora_rank(self) -> int:
        return int(self.kv_c.shape[1])

    @property
    def rope_dim(self) -> int:
        return int(self.k_pe.shape[1])

    @property
    def qk_nope_dim(self) -> int:
        return int(self.q.shape[2]) - self.rope_dim

    @property
    def v_head_dim(self) -> int:
        return int(self.w_kv_b.shape[0]) // self.num_heads - self.qk_nope_dim

    @property
    def num_seqs(self) -> int:
        """B, the batch's sequences."""
        return len(self.q_cu_seq_lens) - 1


def validate_latent(
    q: object,
    kv_c: object,
    k_pe: object,
    w_kv_b: object,
    q_cu_seq_lens: object,
    kv_cu_seq_lens: object | None,
    *,
    causal: bool,
    scale: float | None,
) -> LatentBatch:
    """Check every rule of `latent_attention`'s contract; raise `InvalidInputError` naming the
    first one broken."""
    q = check_tensor("q", q, "[Tq, H, Dqk]")
    kv_c = check_tensor("kv_c", kv_c, "[Tk, kv_lora_rank]")
    k_pe = check_tensor("k_pe", k_pe, "[Tk, rope_dim]")
    w_kv_b = check_tensor("w_kv_b", w_kv_b, "[H * (qk_nope_dim + v_head_dim), kv_lora_rank]")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("w_kv_b", w_kv_b)):
        if t.dtype != q.dtype:
            raise InvalidInputError(name, f"the dtype of q ({q.dtype})", str(t.dtype))
    tq, h, dqk = q.shape
    tk, rank = kv_c.shape
    if h < 1 or dqk < 1:
        raise InvalidInputError("q", "H >= 1 and Dqk >= 1", f"shape {tuple(q.shape)}")
    if rank < 1:
        raise InvalidInputError("kv_c", "kv_lora_rank >= 1", f"shape {tuple(kv_c.shape)}")
    if k_pe.shape[0] != tk:
        raise InvalidInputError(
            "k_pe", f"[Tk={tk}, rope_dim] (the tokens of kv_c)", f"shape {tuple(k_pe.shape)}"
        )
    rope = int(k_pe.shape[1])
    if rope >= dqk:
        raise InvalidInputError(
            "k_pe",
            f"rope_dim < Dqk = {dqk} (q is q_nope then q_pe)",
            f"rope_dim = {rope}",
        )
    nope = dqk - rope
    rows, w_rank = w_kv_b.shape
    if w_rank != rank:
        raise InvalidInputError(
            "w_kv_b",
            f"[H * (qk_nope_dim + v_head_dim), kv_lora_rank={rank}] (the rank of kv_c)",
            f"shape {tuple(w_kv_b.shape)}",
        )
    if rows % h or rows // h <= nope:
        raise InvalidInputError(
            "w_kv_b",
            f"H={h} heads of qk_nope_dim={nope} rows then v_head_dim >= 1 rows each "
            f"(a multiple of {h} over {h * nope})",
            f"{rows} rows",
            "kv_b_proj's weight is [out, in]: pass the Linear's weight, not its transpose",
        )
    q_cu, kv_cu = check_offsets(q_cu_seq_lens, kv_cu_seq_lens, tq, tk, keys="kv_c")
    return LatentBatch(q, kv_c, k_pe, w_kv_b, q_cu, kv_cu, bool(causal), check_scale(scale, dqk))


@overload
def latent_attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None = None,
    *,
    causal: bool = True,
    return_lse: Literal[False] = False,
    scale: float | None = None,
    form: Form = "auto",
) -> torch.Tensor: ...
@overload
def latent_attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None = None,
    *,
    causal: bool = True,
    return_lse: Literal[True],
    scale: float | None = None,
    form: Form = "auto",
) -> tuple[torch.Tensor, torch.Tensor]: ...
def latent_attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None = None,
    *,
    causal: bool = True,
    return_lse: bool = False,
    scale: float | None = None,
    form: Form = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA attention over a ragged ("varlen") batch of `B` sequences, keys and values made from
    the latent cache: what `ragged_attention` computes on the expanded keys
    `k[t, h] = concat(kv_c[t] @ W_k[h].T, k_pe[t])` and values `v[t, h] = kv_c[t] @ W_v[h].T`,
    where `W_k[h]`, `W_v[h]` are rows `[h * (Dn + Dv), + Dn)` and `[h * (Dn + Dv) + Dn, + Dv)`
    of `w_kv_b`, without ever holding the context's expanded keys and values.

    Args:
        q: `[Tq, H, Dqk]`, bf16, fp16 or fp32: `q_nope` (Dn = Dqk - P) then `q_pe` (P).
        kv_c: `[Tk, R]`, q's dtype, the latent (R = kv_lora_rank, 512 in DeepSeek-V3).
        k_pe: `[Tk, P]`, q's dtype, the rope key every head shares (P = 64).
        w_kv_b: `[H * (Dn + Dv), R]`, q's dtype, `kv_b_proj`'s weight (a Linear's, out x in).
        q_cu_seq_lens: `[B + 1]` int32/int64 offsets into q, `0 = c[0] <= ... <= c[B] = Tq`.
        kv_cu_seq_lens: `[B + 1]` offsets into kv_c/k_pe; None means `q_cu_seq_lens`.
        causal: query i of a sequence sees keys `j <= i + Sk - Sq` (bottom-right aligned).
        return_lse: also return the softmax log-sum-exp.
        scale: score scale, default `Dqk ** -0.5`.
        form: "expand", "absorb", or "auto": per sequence, absorb where its new tokens Sq are
            fewer than `CROSSOVER`, expand otherwise (a batch may use both).

    Returns:
        out `[Tq, H, Dv]` in q's dtype, or `(out, lse)` with lse `[H, Tq]` fp32 (natural log).
        Queries that see no key get `out = 0`, `lse = -inf`.

    Raises:
        InvalidInputError (a ValueError) naming the tensor or argument at fault.

    Memory beyond the inputs and results, all fp32: `w_kv_b`; one block of `KEY_BLOCK` keys
    (expand: their k_nope and v, H (Dn + Dv) floats a key; absorb: [kv_c, k_pe]); one block of
    scores (`SCORE_BUDGET_BYTES`); expand: q and the running softmax `[H, Sq, Dv]` of the whole
    sequence (so each key block is made once); absorb: one query block's `[H, rows, R + P]`
    queries and `[H, rows, R]` running output. About 26 MiB for a 16k context, 256 new tokens
    and DeepSeek-V3's 16 heads, expanding.
    """
    if form not in FORMS:
        raise InvalidInputError("form", '"expand", "absorb" or "auto"', repr(form))
    batch = validate_latent(
        q, kv_c, k_pe, w_kv_b, q_cu_seq_lens, kv_cu_seq_lens, causal=causal, scale=scale
    )
    out, lse = _attend(batch, form)
    return (out, lse) if return_lse else out


def _attend(batch: LatentBatch, form: Form) -> tuple[torch.Tensor, torch.Tensor]:
    tq, h = batch.q.shape[:2]
    out = torch.empty(tq, h, batch.v_head_dim, dtype=batch.q.dtype)
    # written whether asked for or not: the log of the softmax's running sum, H x Tq floats
    lse = torch.empty(h, tq, dtype=torch.float32)
    nope, dv, rank = batch.qk_nope_dim, batch.v_head_dim, batch.kv_lora_rank
    w = batch.w_kv_b.to(torch.float32).reshape(h, nope + dv, rank)
    qc, kc = batch.q_cu_seq_lens, batch.kv_cu_seq_lens
    for r in range(batch.num_seqs):
        sq, sk = qc[r + 1] - qc[r], kc[r + 1] - kc[r]
        if sq == 0:
            continue
        # Queries that see no key (all of them without keys; the first Sq - Sk when causal)
        # are answered here; the rest are bottom-right aligned on their own (Sq' <= Sk).
        blind = sq if sk == 0 else (max(0, sq - sk) if batch.causal else 0)
        start = qc[r] + blind
        out[qc[r] : start].zero_()
        lse[:, qc[r] : start].fill_(float("-inf"))
        if blind == sq:
            continue
        keys = slice(kc[r], kc[r + 1])
        attend = _absorb if form == "absorb" or (form == "auto" and sq < CROSSOVER) else _expand
        attend(
            batch.q[start : qc[r + 1]],
            batch.kv_c[keys],
            batch.k_pe[keys],
            w,
            batch.causal,
            batch.scale,
            out[start : qc[r + 1]],
            lse[:, start : qc[r + 1]],
        )
    return out, lse


def _query_rows(heads: int) -> int:
    """Queries of one block: `heads x rows x KEY_BLOCK` fp32 scores within the budget."""
    return max(1, SCORE_BUDGET_BYTES // (4 * heads * KEY_BLOCK))


def _hidden(a: int, b: int, k0: int, k1: int, off: int) -> torch.Tensor:
    """`[b - a, k1 - k0]` True where query i (of a, ..., b - 1) may not see key j (of k0, ...,
    k1 - 1): `j > i + off`."""
    return torch.arange(k0, k1)[None, :] > (torch.arange(a, b) + off)[:, None]


def _rescale(
    scores: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor, acc: torch.Tensor
) -> None:
    """One step of the online softmax: `scores [..., n]` become their weights under the new
    running max, and `row_max`, `row_sum` (`[...]`) and `acc` (`[..., D]`) are brought to it; the
    caller adds `scores @ values` to `acc`. A row may see no key of a later block, but every query
    a form takes sees key 0, in the first: no running max is -inf after it."""
    new_max = torch.maximum(row_max, scores.amax(-1))
    alpha = (row_max - new_max).exp_()
    scores.sub_(new_max.unsqueeze(-1)).exp_()
    row_sum.mul_(alpha).add_(scores.sum(-1))
    acc.mul_(alpha.unsqueeze(-1))
    row_max.copy_(new_max)


def _expand(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w: torch.Tensor,
    causal: bool,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """One sequence by the expand form: keys outer (each block made once), queries inner.

    q `[S, H, Dqk]`, kv_c `[Sk, R]`, k_pe `[Sk, P]`, w `[H, Dn + Dv, R]` fp32, out `[S, H, Dv]`,
    lse `[H, S]`; causal with `S <= Sk` (every query sees a key)."""
    s, h, dqk = q.shape
    sk, rank = kv_c.shape
    nope = dqk - k_pe.shape[1]
    dv = w.shape[1] - nope
    off = sk - s
    rows = _query_rows(h)
    starts = range(0, s, rows)
    # Heads first, the scale folded in, one contiguous tensor a query block, as is the block's
    # running state: torch runs a bmm into a strided slice as one matmul per head.
    qh = q.to(torch.float32).transpose(0, 1).mul(scale)
    q_blocks = [qh[:, a : a + rows].contiguous() for a in starts]
    del qh
    row_max = [torch.full(qb.shape[:2], float("-inf")) for qb in q_blocks]
    row_sum = [torch.zeros(qb.shape[:2]) for qb in q_blocks]
    acc = [torch.zeros(*qb.shape[:2], dv) for qb in q_blocks]
    w_rows = w.view(h * (nope + dv), rank)
    for k0 in range(0, sk, KEY_BLOCK):
        k1 = min(sk, k0 + KEY_BLOCK)
        # k_nope^T and v^T of the block for every head, one matmul: [H, Dn + Dv, n]
        kv = torch.mm(w_rows, kv_c[k0:k1].to(torch.float32).t()).view(h, nope + dv, k1 - k0)
        k_t = torch.empty(h, dqk, k1 - k0)
        k_t[:, :nope] = kv[:, :nope]
        k_t[:, nope:] = k_pe[k0:k1].t()  # every head's
        v = kv[:, nope:].transpose(1, 2)
        for j, a in enumerate(starts):
            b = min(s, a + rows)
            if causal and b - 1 + off < k0:  # no query of the block sees this key block
                continue
            scores = torch.bmm(q_blocks[j], k_t)
            if causal and k1 - 1 > a + off:
                scores.masked_fill_(_hidden(a, b, k0, k1, off), float("-inf"))
            _rescale(scores, row_max[j], row_sum[j], acc[j])
            acc[j].baddbmm_(scores, v)
    for j, a in enumerate(starts):
        b = min(s, a + rows)
        out[a:b] = acc[j].div_(row_sum[j].unsqueeze(-1)).transpose(0, 1)
        lse[:, a:b] = row_sum[j].log_().add_(row_max[j])


def _absorb(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w: torch.Tensor,
    causal: bool,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """One sequence by the absorb form: queries outer, keys inner; every head's queries against
    the one latent key block in one matmul. Shapes as `_expand`'s."""
    s, h, dqk = q.shape
    sk, rank = kv_c.shape
    rope = k_pe.shape[1]
    nope = dqk - rope
    w_k, w_v_t = w[:, :nope], w[:, nope:].transpose(1, 2)  # [H, Dn, R], [H, R, Dv]
    off = sk - s
    rows = _query_rows(h)
    for a in range(0, s, rows):
        b = min(s, a + rows)
        n_q = b - a
        qh = q[a:b].to(torch.float32).transpose(0, 1)  # [H, n_q, Dqk]
        # [q_nope W_k, q_pe] scaled: the query against the key [kv_c, k_pe]
        q_lat = torch.empty(h, n_q, rank + rope)
        q_lat[..., :rank] = torch.bmm(qh[..., :nope], w_k)
        q_lat[..., rank:] = qh[..., nope:]
        q_lat = q_lat.mul_(scale).view(h * n_q, rank + rope)
        del qh
        row_max = torch.full((h * n_q,), float("-inf"))
        row_sum = torch.zeros(h * n_q)
        o_lat = torch.zeros(h * n_q, rank)
        # keys past the block's last query's last visible one are never read
        end = min(sk, b + off) if causal else sk
        for k0 in range(0, end, KEY_BLOCK):
            k1 = min(end, k0 + KEY_BLOCK)
            key = torch.empty(k1 - k0, rank + rope)
            key[:, :rank] = kv_c[k0:k1]
            key[:, rank:] = k_pe[k0:k1]
            scores = torch.mm(q_lat, key.t())
            if causal and k1 - 1 > a + off:
                hidden = _hidden(a, b, k0, k1, off)
                scores.view(h, n_q, k1 - k0).masked_fill_(hidden, float("-inf"))
            _rescale(scores, row_max, row_sum, o_lat)
            o_lat.addmm_(scores, key[:, :rank])
        o_lat.div_(row_sum.unsqueeze(-1))
        out[a:b] = torch.bmm(o_lat.view(h, n_q, rank), w_v_t).transpose(0, 1)
        lse[:, a:b] = row_sum.log_().add_(row_max).view(h, n_q)
