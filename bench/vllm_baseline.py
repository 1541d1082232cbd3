"""vLLM's CPU MLA prefill backends, re-expressed for side-by-side timing (not imported: vLLM
does not install here). What they do, per request of a ragged batch:

- `ZenCPUSDPAMLAPrefillBackend` (no LSE): transpose q/k/v to `[1, H, S, D]` and make each
  contiguous, pad V to Dqk, call `zentorch_sdpa` with its (top-left) `is_causal`, transpose
  back, slice the padding off, and `torch.cat` the requests.
- the fp32 path both backends use when an LSE is asked for: upcast to fp32, one `[H, Sq, Sk]`
  score matrix, boolean triangle mask, softmax, matmul, logsumexp, `torch.cat`.
"""

from __future__ import annotations

import torch


def zen_loop(q, k, v, q_cu, kv_cu, *, causal: bool, scale: float) -> torch.Tensor:
    import zentorch  # noqa: F401  registers torch.ops.zentorch

    outs = []
    qc, kc = q_cu.tolist(), kv_cu.tolist()
    pad = q.shape[-1] - v.shape[-1]
    for r in range(len(qc) - 1):
        qs = q[qc[r] : qc[r + 1]].transpose(0, 1).unsqueeze(0).contiguous()
        ks = k[kc[r] : kc[r + 1]].transpose(0, 1).unsqueeze(0).contiguous()
        vs = v[kc[r] : kc[r + 1]].transpose(0, 1).unsqueeze(0).contiguous()
        vs = torch.nn.functional.pad(vs, (0, pad))
        attn, _ = torch.ops.zentorch.zentorch_sdpa(
            qs, ks, vs, 0.0, causal, attn_mask=None, scale=scale
        )
        outs.append(attn[0].transpose(0, 1)[..., : v.shape[-1]].to(v.dtype))
    return torch.cat(outs, dim=0)


def fp32_lse_path(q, k, v, q_cu, kv_cu, *, causal: bool, scale: float):
    outs, lses = [], []
    qc, kc = q_cu.tolist(), kv_cu.tolist()
    for r in range(len(qc) - 1):
        qr = q[qc[r] : qc[r + 1]].transpose(0, 1).float()
        kr = k[kc[r] : kc[r + 1]].transpose(0, 1).float()
        vr = v[kc[r] : kc[r + 1]].transpose(0, 1).float()
        scores = torch.matmul(qr, kr.transpose(-2, -1)) * scale
        if causal:
            hidden = torch.ones(qr.shape[1], kr.shape[1], dtype=torch.bool).triu(1)
            scores.masked_fill_(hidden.unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        outs.append(torch.matmul(probs, vr).transpose(0, 1).to(v.dtype))
        lses.append(torch.logsumexp(scores, dim=-1))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)
