"""zen_mla.merge: the parts of a prefill step, merged by LSE, are the whole attention.

Exact in fp64 (the parts from the fp64 reference add up to the fp64 whole to rounding), and
within the reference's tolerance when the parts come from `ragged_attention`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zen_mla
from tests.prefill_steps import STEP_SPECS, Step, StepSpec, make_step
from tests.reference import assert_close_to_reference, attention_fp64
from zen_mla.attention.merge import merge_attn_states, merge_many

SCALE = 0.3
INF = float("inf")


def fp64_parts(step: Step) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(out, lse) of the new tokens (causal) and of each context chunk (non-causal), fp64."""
    qc = step.query_start_loc.tolist()
    parts = [attention_fp64(step.q, step.k, step.v, qc, qc, causal=True, scale=SCALE)]
    for c in step.context:
        kc = c.cu_seq_lens.tolist()
        parts.append(attention_fp64(step.q, c.k, c.v, qc, kc, causal=False, scale=SCALE))
    return parts


def fp64_whole(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    qc, kc = step.query_start_loc.tolist(), step.full_cu.tolist()
    return attention_fp64(step.q, step.full_k, step.full_v, qc, kc, causal=True, scale=SCALE)


def vllm_order(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's order: context chunks folded pairwise, then context (prefix) with new tokens."""
    (new_out, new_lse), chunks = parts[0], parts[1:]
    if not chunks:
        return new_out, new_lse
    ctx_out, ctx_lse = chunks[0]
    for out, lse in chunks[1:]:
        merged, merged_lse = torch.empty_like(ctx_out), torch.empty_like(ctx_lse)
        merge_attn_states(merged, ctx_out, ctx_lse, out, lse, merged_lse)
        ctx_out, ctx_lse = merged, merged_lse
    result, result_lse = torch.empty_like(new_out), torch.empty_like(new_lse)
    merge_attn_states(result, ctx_out, ctx_lse, new_out, new_lse, result_lse)
    return result, result_lse


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    (out, lse), (want_out, want_lse) = got, want
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    seen = torch.isfinite(want_lse)
    assert torch.allclose(lse[seen], want_lse[seen], rtol=0, atol=1e-12)
    assert torch.allclose(out, want_out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("spec", STEP_SPECS.values(), ids=STEP_SPECS.keys())
def test_fp64_parts_merge_to_the_whole(spec):
    step = make_step(spec, (3, 24, 16), torch.float64)
    parts, whole = fp64_parts(step), fp64_whole(step)
    assert_same(merge_many([o for o, _ in parts], [lse for _, lse in parts]), whole)
    assert_same(vllm_order(parts), whole)


steps = st.integers(1, 4).flatmap(
    lambda b: st.builds(
        StepSpec,
        st.lists(st.integers(0, 9), min_size=b, max_size=b),
        st.lists(st.lists(st.integers(0, 12), min_size=b, max_size=b), max_size=4),
    )
)


@settings(max_examples=60, deadline=None)
@given(spec=steps, seed=st.integers(0, 2**16))
def test_fp64_parts_merge_to_the_whole_for_any_split(spec, seed):
    step = make_step(spec, (2, 8, 8), torch.float64, seed)
    parts, whole = fp64_parts(step), fp64_whole(step)
    assert_same(merge_many([o for o, _ in parts], [lse for _, lse in parts]), whole)
    assert_same(vllm_order(parts), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", STEP_SPECS.values(), ids=STEP_SPECS.keys())
def test_ragged_attention_parts_merge_to_the_whole(spec, dtype):
    """What the backend does, in process: parts from `ragged_attention`, merged in fp32, as
    close to the fp64 whole as attention computed in one piece must be."""
    step = make_step(spec, (4, 192, 128), dtype)
    q, qc = step.q, step.query_start_loc
    parts = [zen_mla.ragged_attention(q, step.k, step.v, qc, return_lse=True, scale=SCALE)]
    for c in step.context:
        parts.append(
            zen_mla.ragged_attention(
                q, c.k, c.v, qc, c.cu_seq_lens, causal=False, return_lse=True, scale=SCALE
            )
        )
    out, lse = merge_many([o for o, _ in parts], [x for _, x in parts])
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_to_reference(
        q, step.full_k, step.full_v, qc, step.full_cu, True, out, lse, scale=SCALE
    )


def _pair(t=3, h=2, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, d, generator=gen), torch.randn(h, t, generator=gen)


def test_plus_inf_is_read_as_minus_inf():
    """FA2 reports a part without keys as +inf: it must weigh nothing."""
    (a, a_lse), (b, b_lse) = _pair(seed=1), _pair(seed=2)
    a_lse[0, 1] = INF
    out, out_lse = torch.empty_like(a), torch.empty_like(a_lse)
    merge_attn_states(out, a, a_lse, b, b_lse, out_lse)
    assert torch.equal(out[1, 0], b[1, 0]) and out_lse[0, 1] == b_lse[0, 1]


def test_a_part_without_keys_leaves_the_other_exactly():
    (a, a_lse), (b, b_lse) = _pair(seed=1), _pair(seed=2)
    a_lse.fill_(-INF)
    out, out_lse = torch.empty_like(a), torch.empty_like(a_lse)
    merge_attn_states(out, a, a_lse, b, b_lse, out_lse)
    assert torch.equal(out, b) and torch.equal(out_lse, b_lse)


@pytest.mark.parametrize("blind", [-INF, INF], ids=["minus_inf", "plus_inf"])
def test_no_part_with_keys_gives_zero_and_minus_inf(blind):
    (a, a_lse), (b, b_lse) = _pair(seed=1), _pair(seed=2)
    a_lse[:, 2] = blind
    b_lse[:, 2] = -INF
    out, out_lse = torch.empty_like(a), torch.empty_like(a_lse)
    merge_attn_states(out, a, a_lse, b, b_lse, out_lse)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isneginf(out_lse[:, 2]).all() and torch.isfinite(out_lse[:, :2]).all()
    assert torch.isfinite(out).all()


def test_computed_in_fp32_written_in_the_output_dtype():
    """bf16 parts with LSEs far apart: the weights are fp32, one rounding at the end."""
    (a, a_lse), (b, b_lse) = _pair(seed=1), _pair(seed=2)
    a_lse += 30.0
    want = torch.empty_like(a)
    merge_attn_states(want, a.bfloat16().float(), a_lse, b.bfloat16().float(), b_lse)
    out = torch.empty(a.shape, dtype=torch.bfloat16)
    merge_attn_states(out, a.bfloat16(), a_lse, b.bfloat16(), b_lse)
    assert torch.equal(out, want.bfloat16())


def test_shape_errors_name_the_tensor():
    (a, a_lse), (b, b_lse) = _pair(), _pair()
    with pytest.raises(zen_mla.InvalidInputError, match=r"suffix_lse: expected \[H, T\]"):
        merge_attn_states(torch.empty_like(a), a, a_lse, b, b_lse.T)
    with pytest.raises(zen_mla.InvalidInputError, match="prefix_output: expected output's shape"):
        merge_attn_states(torch.empty_like(a), a[:2], a_lse, b, b_lse)
    with pytest.raises(zen_mla.InvalidInputError, match="as many LSEs as outputs"):
        merge_many([a, b], [a_lse])
