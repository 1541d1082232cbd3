"""An fp64 attention reference written for the tests, independent of zen_mla's code.

One request at a time, one dense score matrix, the mask built from the contract's sentence:
"query i sees keys j <= i + Sk - Sq".
"""

from __future__ import annotations

import torch


def attention_fp64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu: list[int],
    kv_cu: list[int],
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out `[Tq, H, Dv]` fp64 and lse `[H, Tq]` fp64 for ragged q/k/v."""
    tq, h, _ = q.shape
    out = torch.zeros(tq, h, v.shape[2], dtype=torch.float64)
    lse = torch.full((h, tq), float("-inf"), dtype=torch.float64)
    for r in range(len(q_cu) - 1):
        qa, qb, ka, kb = q_cu[r], q_cu[r + 1], kv_cu[r], kv_cu[r + 1]
        sq, sk = qb - qa, kb - ka
        if sq == 0 or sk == 0:
            continue
        qr = q[qa:qb].double().permute(1, 0, 2)  # [H, Sq, D]
        kr = k[ka:kb].double().permute(1, 0, 2)
        vr = v[ka:kb].double().permute(1, 0, 2)
        scores = torch.einsum("hid,hjd->hij", qr, kr) * scale
        if causal:
            i = torch.arange(sq).unsqueeze(1)
            j = torch.arange(sk).unsqueeze(0)
            scores = scores.masked_fill(j > i + (sk - sq), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [H, Sq], -inf where nothing is seen
        seen = torch.isfinite(row_lse)
        probs = torch.where(seen.unsqueeze(-1), torch.exp(scores - row_lse.unsqueeze(-1)), 0.0)
        out[qa:qb] = torch.einsum("hij,hjd->ihd", probs, vr)
        lse[:, qa:qb] = row_lse
    return out, lse


def attention_same_precision(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu: list[int],
    kv_cu: list[int],
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Plain PyTorch in the inputs' own dtype (scores, probabilities and products rounded to
    it): the error a same-precision implementation makes, which sets the tolerance.

    The products multiply fp32 copies and round to the dtype, as a bf16 or fp16 GEMM does
    (fp32 accumulation, one rounding of each result): a CPU without bf16 arithmetic (AVX2)
    runs a bf16 `torch.matmul` on a scalar loop, 0.3 GFLOP/s on an EPYC Zen 3."""
    tq, h, _ = q.shape
    out = torch.zeros(tq, h, v.shape[2], dtype=q.dtype)
    for r in range(len(q_cu) - 1):
        qa, qb, ka, kb = q_cu[r], q_cu[r + 1], kv_cu[r], kv_cu[r + 1]
        sq, sk = qb - qa, kb - ka
        if sq == 0 or sk == 0:
            continue
        qr, kr, vr = (t.permute(1, 0, 2) for t in (q[qa:qb], k[ka:kb], v[ka:kb]))
        scores = _product((qr * scale), kr.transpose(1, 2))
        if causal:
            i = torch.arange(sq).unsqueeze(1)
            j = torch.arange(sk).unsqueeze(0)
            scores = scores.masked_fill(j > i + (sk - sq), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
        out[qa:qb] = _product(probs, vr).permute(1, 0, 2)
    return out


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in a's dtype, multiplied in fp32 and rounded once."""
    return (a.float() @ b.float()).to(a.dtype)


def assert_close_to_reference(q, k, v, q_cu, kv_cu, causal, out, lse=None, scale=None) -> None:
    """flash-attn's rule for out (no worse than twice same-precision PyTorch's error against
    fp64) and 1e-3 for the LSE, -inf exactly where a query sees no key."""
    q_list = q_cu.tolist()
    kv_list = (kv_cu if kv_cu is not None else q_cu).tolist()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref_out, ref_lse = attention_fp64(q, k, v, q_list, kv_list, causal=causal, scale=scale)
    base = attention_same_precision(q, k, v, q_list, kv_list, causal=causal, scale=scale)
    assert out.shape == ref_out.shape and out.dtype == v.dtype
    if out.numel():
        base_err = (base.double() - ref_out).abs().max().item()
        err = (out.double() - ref_out).abs().max().item()
        assert err <= 2 * base_err + 1e-5, f"max error {err:.3g} vs same-precision {base_err:.3g}"
    if lse is not None:
        blind = torch.isinf(ref_lse)
        assert torch.equal(torch.isneginf(lse), blind)
        if (~blind).any():
            assert (lse.double() - ref_lse)[~blind].abs().max().item() <= 1e-3
