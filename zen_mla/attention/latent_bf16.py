"""`latent_attention`'s two forms with bf16 products (`latent.py` says when they run): each
block's products in one bf16 matmul, its attention in zen-mla's native kernel on its AVX-512
BF16 path, blocks merged by their LSEs in fp32.

    expand  each key block's k and v (all heads) in one bf16 matmul, handed with all the
            sequence's queries to the native kernel
    absorb  W_k folded into the queries in bf16, every head's folded queries handed as the rows
            of one head to the native kernel against [kv_c, k_pe]
"""

from __future__ import annotations

import itertools

import torch

__all__ = [
    "ABSORB_ROWS",
    "NATIVE_BLOCK_BYTES",
    "NATIVE_BLOCK_BYTES_PER_QUERY",
    "NATIVE_BLOCK_MAX_BYTES",
    "absorb",
    "expand",
]

#: bf16 products: the bytes of one key block's k and v (bf16, all heads) the expand form makes
#: and hands the native kernel at once (which packs as many again): `NATIVE_BLOCK_BYTES_PER_QUERY`
#: a query of the sequence (a block's merge costs as much as its queries' out: more queries,
#: larger blocks), from `NATIVE_BLOCK_BYTES` to `NATIVE_BLOCK_MAX_BYTES`, a multiple of 256 keys.
#: Measured on an AMD EPYC Zen 5 (2 vCPUs, 16k context, 16 heads, paired): 8 MiB blocks were the
#: fastest from 16 to 256 new tokens (2 and 4 MiB no faster, 16 MiB 5-7 % slower at 16 and 64,
#: 32 MiB 15 %), 24-32 MiB from 1024 to 4096 (8 MiB 6-10 % slower at 1024 and 2048, 48 MiB 5 %)
NATIVE_BLOCK_BYTES = 8 << 20
NATIVE_BLOCK_BYTES_PER_QUERY = 16 << 10
NATIVE_BLOCK_MAX_BYTES = 32 << 20

#: bf16 products: the absorbed query rows (queries x heads) of one native kernel call
ABSORB_ROWS = 4096


def _native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu: list[int],
    kv_cu: list[int],
    scale: float,
    causal: bool,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """zen-mla's native kernel on its AVX-512 BF16 path (`bf16_unavailable()` is None): out
    `[Tq, H, Dv]` bf16 and lse `[H, Tq]` written (any strides), bottom-right causal, queries
    that see no key 0 and -inf."""
    from .kernels.native import blocks

    torch.ops.zen_mla.native_attend(
        q,
        k,
        v,
        torch.tensor(q_cu, dtype=torch.int64),
        torch.tensor(kv_cu, dtype=torch.int64),
        scale,
        causal,
        out,
        lse,
        *blocks(),
        0,  # K and V packed for all heads at once: a block's, as many bytes as k and v
        None,
        "avx512",
    )


def _merge_into(acc: torch.Tensor, m: torch.Tensor, o: torch.Tensor, o_lse: torch.Tensor) -> None:
    """`merge.merge_attn_states` in place and in fp32, a part at a time: `acc` `[S, H, D]` fp32
    and its LSE `m` `[H, S]` (finite: every query saw a key of an earlier part) take the part
    `o` `[S, H, D]`, `o_lse` `[H, S]` (-inf, and o 0, where a query saw none of its keys)."""
    new = torch.logaddexp(m, o_lse)
    mine = (m - new).exp_().t().unsqueeze(-1)
    theirs = (o_lse - new).exp_().t().unsqueeze(-1)
    acc.mul_(mine).addcmul_(o, theirs)
    m.copy_(new)


def _key_edges(sk: int, s: int, step: int, causal: bool) -> list[int]:
    """Key blocks `[e[i], e[i + 1])` of about `step` keys, even, covering `[0, sk)`; causal, the
    last holds every key past the first query's last (`off = sk - s`), which it alone attends
    causally (bottom-right within the block is bottom-right within the sequence); the others
    every query sees whole."""
    n = -(-sk // step)
    edges = [sk * i // n for i in range(n + 1)]
    if causal and len(edges) > 2 and edges[-2] > sk - s + 1:
        head = sk - s + 1  # keys 0..off, seen by every query
        m = -(-head // step)
        edges = [head * i // m for i in range(m + 1)] + [sk]
    return edges


def _native_block(queries: int, heads: int, dqk: int, dv: int) -> int:
    """Keys of one bf16 expand block for `queries` queries (`NATIVE_BLOCK_BYTES`), a multiple of
    256 keys (the kernel's key blocks) where that is 256 or more, at least 1."""
    budget = min(
        NATIVE_BLOCK_MAX_BYTES, max(NATIVE_BLOCK_BYTES, queries * NATIVE_BLOCK_BYTES_PER_QUERY)
    )
    keys = budget // (heads * (dqk + dv) * 2)
    return keys // 256 * 256 if keys >= 256 else max(1, keys)


def expand(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w: torch.Tensor,
    causal: bool,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    exact_lse: bool = True,
) -> None:
    """One sequence by the expand form in bf16 products: per key block, k = [k_nope, k_pe] and
    v of every head made from the latent in one bf16 matmul (fp32 sums, rounded to bf16 as
    vLLM's expansion rounds them), then the native kernel over all the sequence's queries and
    that block, with its LSE; the blocks' results merged by their LSEs in fp32.

    `exact_lse`: k_nope's rounding moves a score by `scale q_nope . dk` (dk = k_nope - bf16(k_nope),
    ~2^-9 of k_nope) and the LSE by the scores' moves weighted by the softmax, to first order:
    dk (one more bf16 matmul, its fp32 sums less the rounded k_nope, rounded) rides beside v as
    Dn more value columns, and `scale q_nope . (softmax-weighted dk)` is added to the LSE
    (what is left, half the moves' variance under the softmax, ~1e-6). Without, the LSE is the
    rounded keys' (out is the same either way).

    q `[S, H, Dqk]`, kv_c `[Sk, R]`, k_pe `[Sk, P]`, w `[H, Dn + Dv, R]` bf16, out
    `[S, H, Dv]`, lse `[H, S]`; causal with `S <= Sk` (every query sees a key)."""
    s, h, dqk = q.shape
    sk, rank = kv_c.shape
    nope = dqk - k_pe.shape[1]
    dv = w.shape[1] - nope
    exact_lse = exact_lse and nope > 0
    w_t = w.reshape(h * (nope + dv), rank).t()
    # W_k's rows of every head, one matrix (the residual's)
    w_k_t = w[:, :nope].reshape(h * nope, rank).t() if exact_lse else w_t
    width = dv + nope if exact_lse else dv  # the kernel's value columns
    # the blocks of k and v alone (dk not counted): out the same with the LSE or without
    edges = _key_edges(sk, s, _native_block(s, h, dqk, dv), causal)
    direct = len(edges) == 2 and not exact_lse  # one block: straight into the results
    acc = m = part = part_lse = None
    for k0, k1 in itertools.pairwise(edges):
        n = k1 - k0
        x = kv_c[k0:k1]
        kv = torch.mm(x, w_t).view(n, h, nope + dv)
        k = torch.empty(n, h, dqk, dtype=q.dtype)
        k[..., :nope] = kv[..., :nope]
        k[..., nope:] = k_pe[k0:k1, None]
        if exact_lse:
            # x W_k^T - bf16(x W_k^T), the subtraction within the matmul's fp32 sums
            rounded = kv[..., :nope].reshape(n, h * nope)
            dk = torch.addmm(rounded, x, w_k_t, beta=-1).view(n, h, nope)
            v = torch.empty(n, h, width, dtype=q.dtype)
            v[..., :dv] = kv[..., nope:]
            v[..., dv:] = dk
            del rounded, dk
            kv = kv[:0]  # k and v are copies: the block's matmul freed before the kernel
        else:
            v = kv[..., nope:]
        block_causal = causal and k1 - 1 > sk - s
        if direct:
            _native(q, k, v, [0, s], [0, n], scale, block_causal, out, lse)
            return
        if part is None or part_lse is None:
            part = torch.empty(s, h, width, dtype=q.dtype)
            part_lse = torch.empty(h, s, dtype=torch.float32)
        _native(q, k, v, [0, s], [0, n], scale, block_causal, part, part_lse)
        del kv, k, v
        if len(edges) == 2:
            acc, m = part, part_lse
        elif acc is None or m is None:
            acc, m = part.to(torch.float32), part_lse.clone()
        else:
            _merge_into(acc, m, part, part_lse)
    assert acc is not None and m is not None
    del part
    out.copy_(acc[..., :dv])
    if exact_lse:
        for a in range(0, s, 256):  # a few MiB of fp32 at a time
            rows = slice(a, a + 256)
            shift = torch.einsum(
                "shd,shd->hs", q[rows, :, :nope].float(), acc[rows, :, dv:].float()
            )
            m[:, rows] += scale * shift
    lse.copy_(m)


def _latent_key(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """`[Sk, R + P]`, `[kv_c, k_pe]` a row, unit last stride: a view where the two are one row
    of vLLM's MLA cache already, else a copy."""
    sk, rank = kv_c.shape
    if (
        kv_c.stride(1) == 1
        and (k_pe.stride(1) == 1 or k_pe.shape[1] <= 1)
        and (kv_c.stride(0) == k_pe.stride(0) or sk <= 1)
        and k_pe.data_ptr() == kv_c.data_ptr() + rank * kv_c.element_size()
        and k_pe.untyped_storage().data_ptr() == kv_c.untyped_storage().data_ptr()
    ):
        return kv_c.as_strided((sk, rank + k_pe.shape[1]), (kv_c.stride(0), 1))
    return torch.cat([kv_c, k_pe], dim=1)


def absorb(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w: torch.Tensor,
    causal: bool,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    exact_lse: bool = True,
) -> None:
    """One sequence by the absorb form in bf16 products: the queries of every head folded
    (`[q_nope W_k, q_pe]`, one bf16 bmm, rounded to bf16) and taken as the rows of a one-head
    problem against the latent key `[kv_c, k_pe]`, values `kv_c`, in the native kernel:
    `ABSORB_ROWS` rows a call, the keys every row of the block sees at once, and causal, the
    block's own diagonal as one sequence a head against its keys repeated; parts merged by
    their LSEs in fp32, then unfolded through W_v (one bf16 bmm). Shapes as `expand`'s.

    `exact_lse`: the folded query's rounding dq (one more bf16 bmm, its fp32 sums less the
    rounded query) moves a score by `scale dq . kv_c`, the LSE by `scale dq . o_lat` (o_lat the
    kernel's out, the softmax-weighted kv_c) to first order, which is added to it: as
    `expand`'s, at the cost of a dot product a row."""
    s, h, dqk = q.shape
    sk, rank = kv_c.shape
    rope = k_pe.shape[1]
    nope = dqk - rope
    width = rank + rope
    key = _latent_key(kv_c, k_pe)
    # [H, Dn, R] and [H, Dv, R], views: bmm copies a transposed weight on every call
    w_k, w_v = w[:, :nope], w[:, nope:]
    off = sk - s
    rows = max(1, ABSORB_ROWS // h)
    for a in range(0, s, rows):
        b = min(s, a + rows)
        n = b - a
        q_nope = q[a:b, :, :nope].transpose(0, 1)
        folded = torch.bmm(q_nope, w_k)
        q_lat = torch.empty(h, n, width, dtype=q.dtype)
        q_lat[..., :rank] = folded
        q_lat[..., rank:] = q[a:b, :, nope:].transpose(0, 1)
        # q_nope W_k - bf16(q_nope W_k), the subtraction within the bmm's fp32 sums
        dq = torch.baddbmm(folded, q_nope, w_k, beta=-1) if exact_lse and nope else None
        del folded
        q_rows = q_lat.view(h * n, 1, width)
        # keys [0, c): every query of the block sees them all
        c = a + off + 1 if causal else sk
        o = torch.empty(h * n, 1, rank, dtype=q.dtype)
        o_lse = torch.empty(1, h * n, dtype=torch.float32)
        _native(
            q_rows, key[:c, None], key[:c, None, :rank], [0, h * n], [0, c], scale, False, o, o_lse
        )
        if causal and n > 1:
            # keys [c, b + off), n - 1 of them: head j's rows a sequence against its own copy,
            # bottom-right causal (row i sees the tail's first i keys)
            t = n - 1
            tail = key[c : b + off].unsqueeze(0).expand(h, t, width).reshape(h * t, 1, width)
            o2 = torch.empty(h * n, 1, rank, dtype=q.dtype)
            o2_lse = torch.empty(1, h * n, dtype=torch.float32)
            cu_q, cu_k = [j * n for j in range(h + 1)], [j * t for j in range(h + 1)]
            _native(q_rows, tail, tail[..., :rank], cu_q, cu_k, scale, True, o2, o2_lse)
            del tail
            acc = o.to(torch.float32)
            _merge_into(acc, o_lse, o2, o2_lse)
            o = acc.to(q.dtype)
        if dq is not None:
            shift = torch.einsum("hnr,hnr->hn", dq.float(), o.view(h, n, rank).float())
            o_lse = o_lse.view(h, n).add(shift, alpha=scale)
        # out^T = W_v o^T a head: the block's o transposed (H n R), not the weight (H R Dv)
        o_t = o.view(h, n, rank).transpose(1, 2).contiguous()
        out[a:b] = torch.bmm(w_v, o_t).permute(2, 0, 1)
        lse[:, a:b] = o_lse.view(h, n)
