"""`latent_attention`'s two forms with fp32 products (`latent.py` says when they run): a flash
loop in torch over fp32 copies of each block, the online softmax kept per query block.

    expand  each block of `KEY_BLOCK` keys' k_nope and v made from its latent (all heads in one
            matmul) as the loop reaches it, shared by every query block of the sequence
    absorb  W_k folded into the queries and W_v into the output: every head attends the one
            latent key [kv_c, k_pe] in (R + P) dims, its R-dim latent values
"""

from __future__ import annotations

import torch

__all__ = ["KEY_BLOCK", "SCORE_BUDGET_BYTES", "absorb", "expand"]

#: keys a block of the fp32 flash loop takes: the expand form makes k_nope and v for this many
#: at once
KEY_BLOCK = 256

#: fp32 scores of one block (queries x heads x keys); the query blocks are sized to it
SCORE_BUDGET_BYTES = 8 << 20


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


def expand(
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


def absorb(
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
    the one latent key block in one matmul. Shapes as `expand`'s."""
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
