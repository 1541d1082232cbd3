"""Every prefill call zen-mla serves inside the engine, recomputed by vLLM's own CPU backend on
the very same tensors, and the difference kept: vLLM's CPU backend is not deterministic from
call to call on a tiny random model, so calls are compared, never tokens across runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch


@dataclass
class Call:
    kind: str  # "new_tokens" or "context_chunk"
    tokens: int
    out_diff: float
    lse_diff: float  # nan where no LSE was asked


@dataclass
class Recording:
    calls: list[Call] = field(default_factory=list)

    def of(self, kind: str) -> list[Call]:
        return [c for c in self.calls if c.kind == kind]

    def worst(self, kind: str | None = None) -> tuple[float, float]:
        calls = self.calls if kind is None else self.of(kind)
        lse = [c.lse_diff for c in calls if not math.isnan(c.lse_diff)]
        return max(c.out_diff for c in calls), max(lse, default=math.nan)


def _lse_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    both_empty = torch.isneginf(got) & torch.isneginf(want)  # no keys: -inf on both sides
    diff = torch.where(both_empty, 0.0, (got.double() - want.double()).abs())
    return float(diff.max()) if diff.numel() else 0.0


def record(monkeypatch: pytest.MonkeyPatch) -> Recording:
    """Wraps the zen-mla backend class vLLM resolves (the plugin's registry entry) so that each
    call is also computed by `CPUSDPAMLAPrefillBackend`; returns what it records."""
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    from zen_mla import vllm as zen_vllm

    cls = zen_vllm.backend_class()
    served_new, served_chunk = cls.run_prefill_new_tokens, cls.run_prefill_context_chunk
    recording = Recording()

    def vllms(backend: Any) -> CPUSDPAMLAPrefillBackend:
        theirs = CPUSDPAMLAPrefillBackend(
            num_heads=backend.num_heads,
            scale=backend.scale,
            kv_lora_rank=backend.kv_lora_rank,
            qk_nope_head_dim=backend.qk_nope_head_dim,
            qk_rope_head_dim=backend.qk_rope_head_dim,
            v_head_dim=backend.v_head_dim,
            vllm_config=backend.vllm_config,
        )
        theirs.prepare_metadata(backend._prefill_metadata)
        return theirs

    def new_tokens(self, q, k, v, return_softmax_lse, out=None, output_scale=None):  # type: ignore[no-untyped-def]
        got = served_new(self, q, k, v, return_softmax_lse, out, output_scale)
        want = vllms(self).run_prefill_new_tokens(q, k, v, return_softmax_lse)
        if return_softmax_lse:
            (got_out, got_lse), (want_out, want_lse) = got, want
            lse_diff = _lse_diff(got_lse, want_lse)
        else:
            got_out, want_out, lse_diff = got, want, math.nan
        diff = float((got_out.double() - want_out.double()).abs().max())
        recording.calls.append(Call("new_tokens", q.shape[0], diff, lse_diff))
        return got

    def context_chunk(self, chunk, q, k, v, out=None):  # type: ignore[no-untyped-def]
        got_out, got_lse = served_chunk(self, chunk, q, k, v, out)
        want_out, want_lse = vllms(self).run_prefill_context_chunk(chunk, q, k, v)
        diff = float((got_out.double() - want_out.double()).abs().max())
        recording.calls.append(
            Call("context_chunk", q.shape[0], diff, _lse_diff(got_lse, want_lse))
        )
        return got_out, got_lse

    monkeypatch.setattr(cls, "run_prefill_new_tokens", new_tokens)
    monkeypatch.setattr(cls, "run_prefill_context_chunk", context_chunk)
    return recording
