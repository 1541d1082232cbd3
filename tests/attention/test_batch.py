"""Every rule of the ragged batch (zen_mla.attention.batch), broken once: a ValueError that
names the tensor, expected and got."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zen_mla
from zen_mla import InvalidInputError


def _good():
    q = torch.randn(10, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(12, 2, 16, dtype=torch.bfloat16)
    v = torch.randn(12, 2, 8, dtype=torch.bfloat16)
    return {
        "q": q,
        "k": k,
        "v": v,
        "q_cu_seq_lens": torch.tensor([0, 4, 10], dtype=torch.int32),
        "kv_cu_seq_lens": torch.tensor([0, 5, 12], dtype=torch.int32),
    }


BAD_INPUTS = {
    "q_not_tensor": ({"q": [[1.0]]}, "q", "torch.Tensor"),
    "q_2d": ({"q": torch.randn(10, 32, dtype=torch.bfloat16)}, "q", "3-D"),
    "q_int": ({"q": torch.ones(10, 2, 16, dtype=torch.int32)}, "q", "dtype"),
    "q_fp64": ({"q": torch.randn(10, 2, 16, dtype=torch.float64)}, "q", "dtype"),
    "k_dtype_differs": ({"k": torch.randn(12, 2, 16)}, "k, v", "dtype of q"),
    "v_dtype_differs": ({"v": torch.randn(12, 2, 8, dtype=torch.float16)}, "k, v", "dtype of q"),
    "k_heads": ({"k": torch.randn(12, 3, 16, dtype=torch.bfloat16)}, "k", "H=2"),
    "k_head_dim": ({"k": torch.randn(12, 2, 8, dtype=torch.bfloat16)}, "k", "Dqk=16"),
    "v_tokens": ({"v": torch.randn(11, 2, 8, dtype=torch.bfloat16)}, "v", "Tk=12"),
    "v_heads": ({"v": torch.randn(12, 1, 8, dtype=torch.bfloat16)}, "v", "H=2"),
    "v_head_dim_too_big": ({"v": torch.randn(12, 2, 17, dtype=torch.bfloat16)}, "v", "Dv <= Dqk"),
    "q_zero_heads": (
        {
            "q": torch.randn(10, 0, 16, dtype=torch.bfloat16),
            "k": torch.randn(12, 0, 16, dtype=torch.bfloat16),
            "v": torch.randn(12, 0, 8, dtype=torch.bfloat16),
        },
        "q",
        "H >= 1",
    ),
    "cu_float": ({"q_cu_seq_lens": torch.tensor([0.0, 4.0, 10.0])}, "q_cu_seq_lens", "int32"),
    "cu_2d": ({"q_cu_seq_lens": torch.tensor([[0, 4, 10]])}, "q_cu_seq_lens", "1-D"),
    "cu_empty": ({"q_cu_seq_lens": torch.tensor([], dtype=torch.int32)}, "q_cu_seq_lens", "1-D"),
    "cu_start": ({"q_cu_seq_lens": torch.tensor([1, 4, 10])}, "q_cu_seq_lens", "[0] == 0"),
    "cu_decreasing": (
        {"q_cu_seq_lens": torch.tensor([0, 6, 4, 10])},
        "q_cu_seq_lens",
        "non-decreasing",
    ),
    "cu_end": ({"q_cu_seq_lens": torch.tensor([0, 4, 9])}, "q_cu_seq_lens", "Tq = 10"),
    "kv_cu_end": ({"kv_cu_seq_lens": torch.tensor([0, 5, 13])}, "kv_cu_seq_lens", "Tk = 12"),
    "kv_cu_batch": ({"kv_cu_seq_lens": torch.tensor([0, 12])}, "kv_cu_seq_lens", "3 offsets"),
    "kv_cu_missing": ({"kv_cu_seq_lens": None}, "kv_cu_seq_lens", "different token count"),
    "scale_nan": ({"scale": math.nan}, "scale", "finite"),
    "scale_inf": ({"scale": math.inf}, "scale", "finite"),
    "scale_zero": ({"scale": 0.0}, "scale", "> 0"),
    "scale_negative": ({"scale": -0.1}, "scale", "> 0"),
    "scale_string": ({"scale": "0.1"}, "scale", "float"),
}


@pytest.mark.parametrize(("change", "name", "expected"), BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_names_the_tensor(change, name, expected):
    args = _good() | change
    with pytest.raises(InvalidInputError) as info:
        zen_mla.ragged_attention(**args)
    assert isinstance(info.value, ValueError)
    assert info.value.name == name
    assert str(info.value).startswith(f"{name}: expected ")
    assert expected in str(info.value)
    assert "got" in str(info.value)


def test_good_input_passes():
    out = zen_mla.ragged_attention(**_good())
    assert out.shape == (10, 2, 8)


def test_a_batch_counts_its_sequences_and_the_old_name_still_answers():
    from zen_mla.attention import validate

    batch = validate(**_good(), causal=True, scale=None)
    assert batch.num_seqs == len(_good()["q_cu_seq_lens"]) - 1
    with pytest.warns(DeprecationWarning, match="num_seqs"):
        assert batch.num_requests == batch.num_seqs


def test_zero_tokens_and_zero_sequences_are_valid():
    q = torch.empty(0, 2, 16)
    v = torch.empty(0, 2, 8)
    out, lse = zen_mla.ragged_attention(q, q, v, torch.tensor([0]), return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    out = zen_mla.ragged_attention(q, q, v, torch.tensor([0, 0, 0]))
    assert out.shape == (0, 2, 8)


@settings(max_examples=200, deadline=None)
@given(
    offsets=st.lists(st.integers(-3, 12), min_size=0, max_size=6),
    dtype=st.sampled_from([torch.int32, torch.int64, torch.int16, torch.float32]),
)
def test_cu_seq_lens_property(offsets, dtype):
    """Any offsets either validate (and then obey every rule) or raise InvalidInputError."""
    q = torch.randn(10, 1, 4)
    cu = torch.tensor(offsets, dtype=dtype)
    try:
        out = zen_mla.ragged_attention(q, q, q, cu, kernel="reference")
    except InvalidInputError as exc:
        assert exc.name == "q_cu_seq_lens"
        return
    assert dtype in (torch.int32, torch.int64)
    assert offsets[0] == 0 and offsets[-1] == 10
    assert all(a <= b for a, b in itertools.pairwise(offsets))
    assert out.shape == (10, 1, 4)


@settings(max_examples=60, deadline=None)
@given(
    q_lens=st.lists(st.integers(0, 40), min_size=0, max_size=150),
    kv_extra=st.lists(st.integers(0, 40), min_size=150, max_size=150),
    causal=st.booleans(),
)
def test_visible_pairs_summed_in_python_and_in_torch_agree(q_lens, kv_extra, causal):
    """Few requests are summed in Python, many in torch (`SMALL_BATCH`): the same count."""
    from zen_mla.attention.batch import SMALL_BATCH, total_visible_pairs, visible_pairs

    q_cu = tuple(itertools.accumulate(q_lens, initial=0))
    kv_cu = tuple(
        itertools.accumulate((a + b for a, b in zip(q_lens, kv_extra, strict=False)), initial=0)
    )
    expected = sum(
        visible_pairs(q_cu[r + 1] - q_cu[r], kv_cu[r + 1] - kv_cu[r], causal)
        for r in range(len(q_lens))
    )
    assert total_visible_pairs(q_cu, kv_cu, causal) == expected
    assert SMALL_BATCH < 151  # both paths are drawn (up to 151 offsets)


@pytest.mark.parametrize("entries", [10, 200], ids=["python", "torch"])
def test_offsets_are_checked_alike_in_python_and_in_torch(entries):
    """A few offsets are checked in Python, many in torch: the same errors, word for word."""
    tq = entries - 1
    q = torch.zeros(tq, 1, 8)
    cu = torch.arange(entries, dtype=torch.int32)
    assert zen_mla.ragged_attention(q, q, q, cu).shape == (tq, 1, 8)
    bad = cu.clone()
    bad[4] = 1
    with pytest.raises(InvalidInputError, match=r"q_cu_seq_lens\[4\] = 1 < q_cu_seq_lens\[3\] = 3"):
        zen_mla.ragged_attention(q, q, q, bad)
    with pytest.raises(InvalidInputError, match=r"q_cu_seq_lens\[0\] == 5"):
        zen_mla.ragged_attention(q, q, q, cu + 5)
    with pytest.raises(InvalidInputError, match=rf"q_cu_seq_lens\[-1\] = {tq - 1}"):
        zen_mla.ragged_attention(q, q, q, cu[:-1])
