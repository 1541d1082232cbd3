"""Prefill steps with cached context, as vLLM's MLA path splits them: each request's new tokens
(causal over themselves) and its context in chunks (non-causal), built with the whole attention
the parts must add up to (bottom-right causal over context + new tokens). No pytest here:
bench/vllm_backend.py builds its steps with it too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.batches import cu_seq_lens
from zen_mla.vllm import ContextKV


@dataclass(frozen=True)
class StepSpec:
    new_lens: list[int]
    chunk_lens: list[list[int]]  # per chunk, each request's context keys in it


STEP_SPECS = {
    "two_chunks": StepSpec([3, 5], [[4, 0], [2, 6]]),  # request 1 has no keys in chunk 0
    "requests_without_context": StepSpec([4, 7, 2], [[0, 5, 0], [0, 3, 0]]),
    "request_without_new_tokens": StepSpec([0, 6], [[3, 2]]),
    "one_chunk": StepSpec([16], [[40]]),
    "many_chunks": StepSpec([9, 1], [[8, 8], [8, 8], [8, 0], [3, 8]]),
    "no_context": StepSpec([5, 3], []),
    "longer": StepSpec([64, 32], [[128, 96], [64, 0]]),
}


@dataclass
class Step:
    q: torch.Tensor  # [T, H, Dqk]
    k: torch.Tensor  # [T, H, Dqk], the new tokens' keys
    v: torch.Tensor  # [T, H, Dv]
    query_start_loc: torch.Tensor
    context: list[ContextKV]
    # the whole: every request's context chunks in order, then its new tokens
    full_k: torch.Tensor
    full_v: torch.Tensor
    full_cu: torch.Tensor


def make_step(
    spec: StepSpec, heads: tuple[int, int, int], dtype: torch.dtype, seed: int = 0
) -> Step:
    h, dqk, dv = heads
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int, d: int) -> torch.Tensor:
        return torch.randn(n, h, d, generator=gen).to(dtype)

    t = sum(spec.new_lens)
    q, k, v = rand(t, dqk), rand(t, dqk), rand(t, dv)
    context = []
    for lens in spec.chunk_lens:
        n = sum(lens)
        context.append(ContextKV(rand(n, dqk), rand(n, dv), cu_seq_lens(lens, torch.int32)))
    qc = cu_seq_lens(spec.new_lens, torch.int32).tolist()
    full_k, full_v, full_lens = [], [], []
    for r in range(len(spec.new_lens)):
        ks, vs = [], []
        for c in context:
            a, b = c.cu_seq_lens[r].item(), c.cu_seq_lens[r + 1].item()
            ks.append(c.k[a:b])
            vs.append(c.v[a:b])
        ks.append(k[qc[r] : qc[r + 1]])
        vs.append(v[qc[r] : qc[r + 1]])
        full_k.append(torch.cat(ks))
        full_v.append(torch.cat(vs))
        full_lens.append(full_k[-1].shape[0])
    return Step(
        q,
        k,
        v,
        cu_seq_lens(spec.new_lens, torch.int32),
        context,
        torch.cat(full_k),
        torch.cat(full_v),
        cu_seq_lens(full_lens, torch.int32),
    )
