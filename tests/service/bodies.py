"""What the service tests send: `/prefill` bodies in the wire format, good and slow tensors."""

from __future__ import annotations

import torch

from tests.batches import BATCH_SPECS, make_batch
from zen_mla import wire

OCTET = {"Content-Type": "application/octet-stream"}


def body_of(tensors, meta=None) -> bytes:
    header, chunks = wire.encode(tensors, meta)
    return header + b"".join(bytes(c) for c in chunks)


def good_tensors():
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 32), torch.bfloat16)
    return {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}


def slow_tensors(tokens: int = 3000, heads: int = 8):
    """Work for the fp32 reference kernel, sent non-causal: 3000 tokens ~0.4 s, 6000 ~1.6 s,
    8000 ~3 s on this 2-core machine (the 1 s deadline and the kill tests need the margin)."""
    x = torch.randn(tokens, heads, 192).bfloat16()
    return {
        "q": x,
        "k": x,
        "v": x[..., :128].contiguous(),
        "q_cu_seq_lens": torch.tensor([0, tokens]),
    }
