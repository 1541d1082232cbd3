"""ragged_attention against the fp64 reference, for every kernel, dtype and batch shape class."""

from __future__ import annotations

import pytest
import torch

import zen_mla
from tests.attention.kernels_ran import kernels_ran
from tests.batches import BATCH_SPECS, BatchSpec, cu_seq_lens, make_batch
from tests.reference import assert_close_to_reference, attention_fp64
from zen_mla.attention import kernels

#: each name's kernel class, for the dtypes it takes; "auto" takes every dtype
KERNEL_CLASSES = {**kernels.KERNELS, "auto": kernels.ReferenceKernel}

# The fast tier runs the matrix for the model's head dims in bf16 and fp32; fp16 and equal_64
# run in the full suite only.
HEAD_DIMS = [
    pytest.param((3, 192, 128), id="mla_192_128"),
    pytest.param((2, 64, 64), id="equal_64", marks=pytest.mark.slow),
]
MATRIX_DTYPES = [
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16", marks=pytest.mark.slow),
    pytest.param(torch.float32, id="fp32"),
]
KERNELS = [
    pytest.param("native", marks=pytest.mark.native),
    pytest.param("zentorch", marks=pytest.mark.zentorch),
    "torch",
    "reference",
    "auto",
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", MATRIX_DTYPES)
@pytest.mark.parametrize("heads", HEAD_DIMS)
@pytest.mark.parametrize("spec", BATCH_SPECS.values(), ids=BATCH_SPECS.keys())
def test_matches_fp64_reference(spec, heads, dtype, causal, return_lse, kernel):
    q, k, v, q_cu, kv_cu = make_batch(spec, heads, dtype)
    if dtype not in KERNEL_CLASSES[kernel].dtypes:  # zentorch's fp16, native's fp16 and fp32
        with pytest.raises(zen_mla.KernelUnavailableError, match="lower precision"):
            zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, causal=causal, kernel=kernel)
        return
    got, ran = kernels_ran(
        lambda: zen_mla.ragged_attention(
            q, k, v, q_cu, kv_cu, causal=causal, return_lse=return_lse, kernel=kernel
        )
    )
    out, lse = got if return_lse else (got, None)
    assert_close_to_reference(q, k, v, q_cu, kv_cu, causal, out, lse)
    if return_lse:
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    _assert_ran(kernel, dtype, return_lse, ran, spec)


def _assert_ran(kernel: str, dtype: torch.dtype, return_lse: bool, ran: set[str], spec) -> None:
    """What ran is what `kernel_choice` says, and nothing else; a batch where no query meets
    a key calls no kernel at all."""
    choice = zen_mla.kernel_choice(kernel, dtype, return_lse=return_lse)
    assert choice.lse == (choice.out if return_lse else None)
    kv_lens = spec.kv_lens if spec.kv_lens is not None else spec.q_lens
    meets = any(sq and sk for sq, sk in zip(spec.q_lens, kv_lens, strict=True))
    if choice.out == "reference" or not meets:
        assert ran == set()
    else:
        assert ran == {choice.out}


@pytest.mark.parametrize("kernel", KERNELS)
def test_queries_that_see_no_key_are_zero_and_minus_inf(kernel):
    q, k, v, q_cu, kv_cu = make_batch(
        BATCH_SPECS["more_queries_than_keys"], (2, 64, 32), torch.bfloat16
    )
    (out, lse), ran = kernels_ran(
        lambda: zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, return_lse=True, kernel=kernel)
    )
    _assert_ran(kernel, torch.bfloat16, True, ran, BATCH_SPECS["more_queries_than_keys"])
    # request 0: 10 queries, 4 keys -> the first 6 see nothing; request 1: no keys at all
    blind_rows = [*range(0, 6), *range(10, 15)]
    assert torch.equal(out[blind_rows], torch.zeros_like(out[blind_rows]))
    assert torch.isneginf(lse[:, blind_rows]).all()
    assert torch.isfinite(lse[:, 6:10]).all() and torch.isfinite(lse[:, 15:]).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_custom_scale(kernel):
    bf16 = kernel == "native"  # it takes bf16 alone
    dtype, out_tol, lse_tol = (torch.bfloat16, 2e-2, 1e-3) if bf16 else (torch.float32, 1e-4, 1e-4)
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 48), dtype)
    out, lse = zen_mla.ragged_attention(q, k, v, q_cu, scale=0.37, return_lse=True, kernel=kernel)
    ref_out, ref_lse = attention_fp64(
        q, k, v, q_cu.tolist(), q_cu.tolist(), causal=True, scale=0.37
    )
    assert (out.double() - ref_out).abs().max().item() < out_tol
    assert (lse.double() - ref_lse).abs().max().item() < lse_tol


def test_lse_is_fp32_accurate_where_bf16_scores_would_not_be():
    """Large scores (|s| ~ 100): a bf16-rounded score alone would be off by ~0.4."""
    q, k, v, q_cu, kv_cu = make_batch(
        BatchSpec([64, 17], [256, 300]), (4, 192, 128), torch.bfloat16
    )
    q, k = q * 4, k * 4
    _out, lse = zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, causal=False, return_lse=True)
    _, ref_lse = attention_fp64(
        q, k, v, q_cu.tolist(), kv_cu.tolist(), causal=False, scale=192**-0.5
    )
    assert ref_lse.abs().max() > 50
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3


def test_strided_inputs_are_read_in_place():
    """q/k/v slices of a fused qkv buffer (as a model produces them) need no copy first."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(50, 4, 192 * 2 + 128, generator=gen).bfloat16()
    q, k, v = qkv[..., :192], qkv[..., 192:384], qkv[..., 384:]
    q_cu = torch.tensor([0, 20, 50])
    got = zen_mla.ragged_attention(q, k, v, q_cu, kernel="torch")
    want = zen_mla.ragged_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), q_cu, kernel="torch"
    )
    assert torch.equal(got, want)


def test_last_dim_strided_inputs_are_accepted():
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 64), torch.float32)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # last-dim stride != 1
    assert qt.stride(-1) != 1
    assert torch.allclose(
        zen_mla.ragged_attention(qt, k, v, q_cu, kernel="reference"),
        zen_mla.ragged_attention(q, k, v, q_cu, kernel="reference"),
    )


def test_long_prefix_cached_request_is_masked_in_blocks(monkeypatch):
    """A mask over the memory budget is applied a block of queries at a time."""
    from zen_mla.attention import driver

    monkeypatch.setattr(driver, "MASK_BUDGET_BYTES", 64 * 2 * 7)  # 7 rows of 64 bf16 keys
    q, k, v, q_cu, kv_cu = make_batch(BatchSpec([40], [64]), (2, 64, 32), torch.bfloat16)
    out = zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, kernel="torch")
    ref, _ = attention_fp64(q, k, v, q_cu.tolist(), kv_cu.tolist(), causal=True, scale=64**-0.5)
    assert (out.double() - ref).abs().max().item() < 2e-2


def _merge(out_a, lse_a, out_b, lse_b):
    """vLLM's merge_attn_states: outputs `[T, H, D]`, LSEs `[H, T]`, +inf read as -inf."""
    lse_a = torch.where(torch.isposinf(lse_a), float("-inf"), lse_a).double()
    lse_b = torch.where(torch.isposinf(lse_b), float("-inf"), lse_b).double()
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isneginf(top), 0.0, top)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b
    safe = torch.where(total == 0, 1.0, total)
    out = out_a.double() * (w_a / safe).T[..., None] + out_b.double() * (w_b / safe).T[..., None]
    return out, top + torch.log(total)


@pytest.mark.parametrize("kernel", KERNELS)
def test_context_chunks_merged_by_lse_equal_attention_over_everything(kernel):
    """New tokens (causal) merged with context chunks (non-causal) by LSE, as vLLM's chunked
    prefill does, equal bottom-right causal attention over context + new tokens."""
    new_lens, ctx_chunks = [12, 0, 7, 30], [[20, 0, 5, 64], [9, 3, 0, 64]]
    h, dqk, dv = 3, 192, 128
    gen = torch.Generator().manual_seed(7)
    ctx_lens = [sum(c[r] for c in ctx_chunks) for r in range(len(new_lens))]
    full_lens = [c + n for c, n in zip(ctx_lens, new_lens, strict=True)]
    q = torch.randn(sum(new_lens), h, dqk, generator=gen).bfloat16()
    k_full = torch.randn(sum(full_lens), h, dqk, generator=gen).bfloat16()
    v_full = torch.randn(sum(full_lens), h, dv, generator=gen).bfloat16()
    q_cu, full_cu = cu_seq_lens(new_lens), cu_seq_lens(full_lens)

    def rows(cu, r, a, b):  # rows [a, b) of request r's keys
        return k_full[cu[r] + a : cu[r] + b], v_full[cu[r] + a : cu[r] + b]

    def part(starts, lens, causal):
        pieces = [
            rows(full_cu, r, s, s + n) for r, (s, n) in enumerate(zip(starts, lens, strict=True))
        ]
        ks, vs = zip(*pieces, strict=True)
        return zen_mla.ragged_attention(
            q, torch.cat(ks), torch.cat(vs), q_cu, cu_seq_lens(lens),
            causal=causal, return_lse=True, kernel=kernel,
        )  # fmt: skip

    out, lse = part(ctx_lens, new_lens, causal=True)  # the new tokens over themselves
    start = [0] * len(new_lens)
    for chunk in ctx_chunks:
        out, lse = _merge(out, lse, *part(start, chunk, causal=False))
        start = [s + n for s, n in zip(start, chunk, strict=True)]
    ref_out, ref_lse = attention_fp64(
        q, k_full, v_full, q_cu.tolist(), full_cu.tolist(), causal=True, scale=dqk**-0.5
    )
    assert (lse - ref_lse).abs().max().item() <= 1e-3
    assert (out - ref_out).abs().max().item() <= 2e-2
