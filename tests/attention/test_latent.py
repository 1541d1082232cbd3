"""latent_attention (zen_mla.attention.latent) against an fp64 reference that expands the whole
context's keys and values from the latent and runs plain softmax attention on them: both forms
and "auto", out and LSE, causal and not, in bf16 and fp32, one key block and many, with fp32
products and (bf16 inputs, on a CPU with bf16 arithmetic) bf16 ones; the errors that name the
tensor; and the expand form's peak memory, measured in a fresh process."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.reference import attention_fp64
from zen_mla import InvalidInputError
from zen_mla.attention import latent, latent_bf16, latent_fp32
from zen_mla.attention.latent import latent_attention


@dataclass(frozen=True)
class Dims:
    heads: int
    rank: int  # kv_lora_rank
    rope: int
    nope: int  # qk_nope_dim
    v: int  # v_head_dim


SMALL = Dims(heads=3, rank=32, rope=8, nope=16, v=12)
DIMS = {
    "small": SMALL,
    "deepseek": Dims(heads=2, rank=512, rope=64, nope=128, v=128),
    "odd_v_wider_than_nope": Dims(heads=2, rank=20, rope=3, nope=5, v=9),
    "no_rope": Dims(heads=1, rank=8, rope=0, nope=6, v=4),
}


@dataclass(frozen=True)
class Spec:
    q_lens: list[int]
    kv_lens: list[int] | None = None  # None: the same as q_lens, kv_cu_seq_lens left out


SPECS = {
    "self": Spec([13]),
    "context_plus_new": Spec([5, 12], [40, 30]),
    "ragged_with_empty": Spec([1, 9, 0, 6, 3, 7], [1, 20, 7, 0, 3, 19]),
    "more_queries_than_keys": Spec([10, 6], [4, 6]),
    "no_seqs": Spec([], []),
}

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]

#: the largest error of out against fp64: fp32 math throughout, then one rounding to q's dtype
#: (bf16 keeps 8 bits: 2^-9 of values near 1, a few units of 2^-8 near 4; fp16 11)
OUT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
#: the LSE is fp32 whatever the inputs' dtype; with bf16 products too, where the rounding of
#: k_nope (or of the absorbed query) to bf16 moves it by up to ~3e-3 at these tests' scales, but
#: latent_attention takes that move off to first order when the LSE is asked (1e-5 left)
LSE_TOLERANCE = 1e-4
#: on this host, precision "auto" takes bf16 products for bf16 inputs
BF16_PRODUCTS = latent.bf16_unavailable() is None
needs_bf16_products = pytest.mark.skipif(
    not BF16_PRODUCTS, reason=f"no bf16 products here: {latent.bf16_unavailable()}"
)
PRECISIONS = [pytest.param("fp32", id="fp32_products"), pytest.param("auto", id="auto_products")]


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def _inputs(spec: Spec, dims: Dims, dtype: torch.dtype, seed: int = 0) -> dict[str, object]:
    """q, kv_c, k_pe, w_kv_b of `dtype` (k_nope and v about unit scale) and the offsets."""
    kv_lens = spec.kv_lens if spec.kv_lens is not None else spec.q_lens
    tq, tk = sum(spec.q_lens), sum(kv_lens)
    gen = torch.Generator().manual_seed(seed)
    h = dims.heads
    return {
        "q": torch.randn(tq, h, dims.nope + dims.rope, generator=gen).to(dtype),
        "kv_c": torch.randn(tk, dims.rank, generator=gen).to(dtype),
        "k_pe": torch.randn(tk, dims.rope, generator=gen).to(dtype),
        "w_kv_b": (
            torch.randn(h * (dims.nope + dims.v), dims.rank, generator=gen) / dims.rank**0.5
        ).to(dtype),
        "q_cu_seq_lens": _cu(spec.q_lens),
        "kv_cu_seq_lens": None if spec.kv_lens is None else _cu(kv_lens).long(),
    }


def _reference(
    x: dict[str, object], causal: bool, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 out `[Tq, H, Dv]` and lse `[H, Tq]`: the whole context's keys and values expanded
    from the latent, then plain softmax attention (tests/reference.py)."""
    q, kv_c, k_pe, w = (x[name] for name in ("q", "kv_c", "k_pe", "w_kv_b"))
    assert isinstance(q, torch.Tensor) and isinstance(kv_c, torch.Tensor)
    assert isinstance(k_pe, torch.Tensor) and isinstance(w, torch.Tensor)
    tk, h, rope = kv_c.shape[0], q.shape[1], k_pe.shape[1]
    nope = q.shape[2] - rope
    w_heads = w.double().view(h, -1, kv_c.shape[1])
    k_nope = torch.einsum("tr,hdr->thd", kv_c.double(), w_heads[:, :nope])
    v = torch.einsum("tr,hdr->thd", kv_c.double(), w_heads[:, nope:])
    k = torch.cat([k_nope, k_pe.double()[:, None].expand(tk, h, rope)], dim=-1)
    q_cu = x["q_cu_seq_lens"]
    kv_cu = x["kv_cu_seq_lens"] if x["kv_cu_seq_lens"] is not None else q_cu
    assert isinstance(q_cu, torch.Tensor) and isinstance(kv_cu, torch.Tensor)
    scale = q.shape[2] ** -0.5 if scale is None else scale
    return attention_fp64(q, k, v, q_cu.tolist(), kv_cu.tolist(), causal=causal, scale=scale)


def _assert_close(
    x: dict[str, object],
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale=None,
) -> None:
    ref_out, ref_lse = _reference(x, causal, scale)
    q = x["q"]
    assert isinstance(q, torch.Tensor)
    assert out.shape == ref_out.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    if out.numel():
        err = (out.double() - ref_out).abs().max().item()
        assert err <= OUT_TOLERANCE[q.dtype], f"out: max error {err:.3g}"
    blind = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), blind), "-inf exactly where a query sees no key"
    assert torch.equal(out.transpose(0, 1)[blind], torch.zeros_like(out.transpose(0, 1)[blind]))
    if (~blind).any():
        err = (lse.double() - ref_lse)[~blind].abs().max().item()
        assert err <= LSE_TOLERANCE, f"lse: max error {err:.3g}"


@pytest.fixture(params=["one_block", "small_blocks"])
def blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The module's block sizes as they are, or small enough that every test sequence spans
    several key blocks (4 keys) and query blocks (3 queries of SMALL's heads), with fp32
    products and with bf16 ones."""
    if request.param == "small_blocks":
        monkeypatch.setattr(latent_fp32, "KEY_BLOCK", 4)
        monkeypatch.setattr(latent_fp32, "SCORE_BUDGET_BYTES", 4 * SMALL.heads * 4 * 3)
        # 4 keys of SMALL's k and v, bf16; 3 queries of its heads
        per_key = SMALL.heads * (SMALL.nope + SMALL.rope + SMALL.v) * 2
        monkeypatch.setattr(latent_bf16, "NATIVE_BLOCK_BYTES", 4 * per_key)
        monkeypatch.setattr(latent_bf16, "NATIVE_BLOCK_MAX_BYTES", 4 * per_key)
        monkeypatch.setattr(latent_bf16, "ABSORB_ROWS", 3 * SMALL.heads)
    return str(request.param)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("form", ["expand", "absorb", "auto"])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_matches_fp64_reference(spec, form, causal, dtype, precision, blocks, monkeypatch):
    # auto takes both forms here: sequences of 6 new tokens and more expand
    monkeypatch.setattr(latent, "CROSSOVER", 6)
    monkeypatch.setattr(latent, "CROSSOVER_FP32", 6)
    monkeypatch.setattr(latent, "ABSORB_CONTEXT_KNEE", 0)
    x = _inputs(spec, SMALL, dtype)
    out, lse = latent_attention(**x, causal=causal, return_lse=True, form=form, precision=precision)
    _assert_close(x, out, lse, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", ["expand", "absorb"])
@pytest.mark.parametrize("dims", DIMS.values(), ids=DIMS.keys())
def test_head_dims_come_from_the_tensors(dims, form, dtype):
    x = _inputs(SPECS["context_plus_new"], dims, dtype)
    out, lse = latent_attention(**x, return_lse=True, form=form)
    assert out.shape[-1] == dims.v
    _assert_close(x, out, lse, causal=True)


@pytest.mark.parametrize("form", ["expand", "absorb"])
def test_scale_is_applied_to_the_scores(form):
    x = _inputs(SPECS["context_plus_new"], SMALL, torch.float32)
    out, lse = latent_attention(**x, return_lse=True, scale=0.37, form=form)
    _assert_close(x, out, lse, causal=True, scale=0.37)


@pytest.mark.parametrize("form", ["expand", "absorb"])
def test_latent_and_rope_key_as_views_of_one_cache_row(form, blocks):
    """vLLM's MLA cache holds [kv_c, k_pe] in one row a token: both come as strided views."""
    x = _inputs(SPECS["ragged_with_empty"], SMALL, torch.bfloat16)
    kv_c, k_pe = x["kv_c"], x["k_pe"]
    assert isinstance(kv_c, torch.Tensor) and isinstance(k_pe, torch.Tensor)
    row = torch.cat([kv_c, k_pe], dim=1)
    x |= {"kv_c": row[:, : SMALL.rank], "k_pe": row[:, SMALL.rank :]}
    out, lse = latent_attention(**x, return_lse=True, form=form)
    _assert_close(x, out, lse, causal=True)


@pytest.mark.parametrize("form", ["expand", "absorb", "auto"])
def test_out_alone_without_return_lse(form, blocks):
    """Without the LSE, bf16 products skip its correction (dk beside v, or dq's dot): out is
    the same."""
    x = _inputs(SPECS["context_plus_new"], SMALL, torch.bfloat16)
    out = latent_attention(**x, form=form)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert torch.equal(out, latent_attention(**x, return_lse=True, form=form)[0])


#: each form's function by the name the tests give it: the module it lives in, its name there
FORM_FUNCTIONS = {
    "_expand": (latent_fp32, "expand"),
    "_absorb": (latent_fp32, "absorb"),
    "_expand_bf16": (latent_bf16, "expand"),
    "_absorb_bf16": (latent_bf16, "absorb"),
    "_native": (latent_bf16, "_native"),
}


def _spy(monkeypatch: pytest.MonkeyPatch, names: tuple[str, str]) -> list[tuple[str, int]]:
    """Which of the two form functions `names` each sequence went to, and its queries."""
    took: list[tuple[str, int]] = []
    for name in names:
        module, attr = FORM_FUNCTIONS[name]
        form = getattr(module, attr)

        def spy(q, *args, _form=form, _name=name):
            took.append((_name, q.shape[0]))
            _form(q, *args)

        monkeypatch.setattr(module, attr, spy)
    return took


@pytest.mark.parametrize(
    ("dtype", "precision", "return_lse"),
    [
        pytest.param(torch.float32, "auto", True, id="fp32"),
        pytest.param(torch.bfloat16, "fp32", True, id="bf16_fp32_products"),
        pytest.param(torch.bfloat16, "auto", True, id="bf16", marks=needs_bf16_products),
        pytest.param(torch.bfloat16, "auto", False, id="bf16_out", marks=needs_bf16_products),
        pytest.param(
            torch.bfloat16, "bf16", True, id="bf16_lse_rounded", marks=needs_bf16_products
        ),
    ],
)
def test_auto_takes_each_sequence_by_its_new_tokens(monkeypatch, dtype, precision, return_lse):
    """Absorb below the crossover of the products taken (and, bf16, of the LSE asked or not),
    expand from it, both in one batch (no context knee: absorb exactly where Sq < it)."""
    bf16 = dtype == torch.bfloat16 and precision != "fp32"
    names = ("_expand_bf16", "_absorb_bf16") if bf16 else ("_expand", "_absorb")
    corrected = return_lse and precision == "auto"  # the LSE's rounding move taken off
    crossover = (
        (latent.CROSSOVER_LSE if corrected else latent.CROSSOVER) if bf16 else latent.CROSSOVER_FP32
    )
    monkeypatch.setattr(latent, "ABSORB_CONTEXT_KNEE", 0)
    took = _spy(monkeypatch, names)
    x = _inputs(Spec([crossover - 1, crossover, 3], [400, 500, 0]), SMALL, dtype)
    if return_lse:
        out, lse = latent_attention(**x, causal=False, return_lse=True, precision=precision)
        if precision != "bf16":
            _assert_close(x, out, lse, causal=False)
    else:
        out = latent_attention(**x, causal=False, precision=precision)
        err = (out.double() - _reference(x, causal=False)[0]).abs().max().item()
        assert err <= OUT_TOLERANCE[dtype]
    # the third sequence has no keys: answered without either form
    assert took == [(names[1], crossover - 1), (names[0], crossover)]


#: precision "bf16": the LSE as bf16's rounding of k_nope (or of the absorbed query) leaves it,
#: by up to 2^-9 scale sum_d |q_d k_d| (~1e-2 at these tests' scales; 4e-3 the largest seen)
BF16_LSE_TOLERANCE = 1e-2


@needs_bf16_products
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("form", ["expand", "absorb", "auto"])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_bf16_precision_leaves_the_lse_as_rounded(spec, form, causal, blocks):
    """precision "bf16": out as "auto"'s without the LSE (the same forms), the LSE within the
    rounding's own move."""
    x = _inputs(spec, SMALL, torch.bfloat16)
    out, lse = latent_attention(**x, causal=causal, return_lse=True, form=form, precision="bf16")
    assert torch.equal(out, latent_attention(**x, causal=causal, form=form))
    _, ref_lse = _reference(x, causal)
    blind = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), blind)
    if (~blind).any():
        assert (lse.double() - ref_lse)[~blind].abs().max().item() <= BF16_LSE_TOLERANCE


@needs_bf16_products
def test_auto_expands_short_contexts(monkeypatch):
    """16 new tokens absorb after 2,000 cached ones, expand with none (absorbing is 3x slower
    there), as do 400 new after 20,000 (past the crossover) and 180 after 500."""
    took = _spy(monkeypatch, ("_expand_bf16", "_absorb_bf16"))
    x = _inputs(Spec([16, 16, 400, 180], [2016, 16, 20400, 680]), SMALL, torch.bfloat16)
    out, lse = latent_attention(**x, return_lse=True)
    assert took == [
        ("_absorb_bf16", 16),
        ("_expand_bf16", 16),
        ("_expand_bf16", 400),
        ("_expand_bf16", 180),
    ]
    _assert_close(x, out, lse, causal=True)


def test_no_bf16_products_without_bf16_arithmetic(monkeypatch):
    """Where the CPU lacks bf16 arithmetic (an EPYC Zen 2 / Zen 3: a bf16 matmul is a scalar
    loop there) or the native kernel, bf16 inputs take fp32 products."""
    monkeypatch.setattr(latent, "bf16_unavailable", lambda: "no bf16 arithmetic")
    took = _spy(monkeypatch, ("_expand", "_absorb"))
    for name in ("_expand_bf16", "_absorb_bf16", "_native"):
        monkeypatch.setattr(*FORM_FUNCTIONS[name], None)  # calling one raises
    x = _inputs(Spec([3, 200], [30, 2000]), SMALL, torch.bfloat16)
    out, lse = latent_attention(**x, return_lse=True)
    assert took == [("_absorb", 3), ("_expand", 200)]
    _assert_close(x, out, lse, causal=True)


@needs_bf16_products
def test_bf16_products_on_deepseek_heads_over_several_blocks(monkeypatch):
    """DeepSeek's dims, a context of several key blocks of the module's own size and causal
    diagonals of several absorbed row blocks, both forms against fp64."""
    for name in ("NATIVE_BLOCK_BYTES", "NATIVE_BLOCK_MAX_BYTES"):
        monkeypatch.setattr(latent_bf16, name, 1024 * 2 * 320 * 2)  # 1024 keys
    monkeypatch.setattr(latent_bf16, "ABSORB_ROWS", 2 * 50)  # 50 queries a call
    dims = Dims(heads=2, rank=512, rope=64, nope=128, v=128)
    x = _inputs(Spec([130, 1], [3000, 700]), dims, torch.bfloat16)
    for form in ("expand", "absorb"):
        out, lse = latent_attention(**x, return_lse=True, form=form)
        _assert_close(x, out, lse, causal=True)


def _good() -> dict[str, object]:
    return _inputs(Spec([4, 6], [5, 7]), Dims(heads=2, rank=8, rope=4, nope=6, v=5), torch.bfloat16)


BAD_INPUTS = {
    "q_not_tensor": ({"q": [[1.0]]}, "q", "torch.Tensor"),
    "q_2d": ({"q": torch.randn(10, 20, dtype=torch.bfloat16)}, "q", "3-D"),
    "q_int": ({"q": torch.ones(10, 2, 10, dtype=torch.int32)}, "q", "dtype"),
    "q_fp64": ({"q": torch.randn(10, 2, 10, dtype=torch.float64)}, "q", "dtype"),
    "kv_c_3d": ({"kv_c": torch.randn(12, 1, 8, dtype=torch.bfloat16)}, "kv_c", "2-D"),
    "kv_c_dtype": ({"kv_c": torch.randn(12, 8)}, "kv_c", "dtype of q"),
    "k_pe_dtype": ({"k_pe": torch.randn(12, 4, dtype=torch.float16)}, "k_pe", "dtype of q"),
    "w_dtype": ({"w_kv_b": torch.randn(22, 8)}, "w_kv_b", "dtype of q"),
    "k_pe_tokens": ({"k_pe": torch.randn(11, 4, dtype=torch.bfloat16)}, "k_pe", "Tk=12"),
    "k_pe_as_wide_as_q": ({"k_pe": torch.randn(12, 10, dtype=torch.bfloat16)}, "k_pe", "< Dqk"),
    "w_rank": ({"w_kv_b": torch.randn(22, 9, dtype=torch.bfloat16)}, "w_kv_b", "rank=8"),
    "w_rows_per_head": ({"w_kv_b": torch.randn(23, 8, dtype=torch.bfloat16)}, "w_kv_b", "H=2"),
    "w_no_v_rows": ({"w_kv_b": torch.randn(12, 8, dtype=torch.bfloat16)}, "w_kv_b", "v_head_dim"),
    "w_transposed": ({"w_kv_b": torch.randn(8, 22, dtype=torch.bfloat16)}, "w_kv_b", "rank=8"),
    "q_cu_end": ({"q_cu_seq_lens": torch.tensor([0, 4, 9])}, "q_cu_seq_lens", "Tq = 10"),
    "q_cu_falls": ({"q_cu_seq_lens": torch.tensor([0, 6, 4, 10])}, "q_cu_seq_lens", "non-decr"),
    "q_cu_float": ({"q_cu_seq_lens": torch.tensor([0.0, 4, 10])}, "q_cu_seq_lens", "int32"),
    "kv_cu_end": ({"kv_cu_seq_lens": torch.tensor([0, 5, 13])}, "kv_cu_seq_lens", "Tk = 12"),
    "kv_cu_batch": ({"kv_cu_seq_lens": torch.tensor([0, 12])}, "kv_cu_seq_lens", "3 offsets"),
    "kv_cu_missing": ({"kv_cu_seq_lens": None}, "kv_cu_seq_lens", "different token count"),
    "scale_nan": ({"scale": math.nan}, "scale", "finite"),
    "scale_negative": ({"scale": -0.1}, "scale", "> 0"),
    "scale_string": ({"scale": "0.1"}, "scale", "float"),
    "form": ({"form": "fold"}, "form", '"absorb"'),
    "precision": ({"precision": "fp16"}, "precision", '"fp32"'),
}


@pytest.mark.parametrize(("change", "name", "expected"), BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_names_the_tensor(change, name, expected):
    with pytest.raises(InvalidInputError) as info:
        latent_attention(**(_good() | change))
    assert isinstance(info.value, ValueError)
    assert info.value.name == name
    assert str(info.value).startswith(f"{name}: expected ")
    assert expected in str(info.value)
    assert "got" in str(info.value)


def test_good_input_passes():
    assert latent_attention(**_good()).shape == (10, 2, 5)


def test_zero_tokens_and_zero_sequences_are_valid():
    x = _inputs(Spec([], []), SMALL, torch.float32)
    out, lse = latent_attention(**x, return_lse=True)
    assert out.shape == (0, SMALL.heads, SMALL.v) and lse.shape == (SMALL.heads, 0)
    x = _inputs(Spec([0, 0], [0, 0]), SMALL, torch.float32)
    assert latent_attention(**x).shape == (0, SMALL.heads, SMALL.v)


#: the expand form's case of the memory test: DeepSeek's dims, 16 heads, a 16k context
MEMORY_CASE = {"heads": 16, "context": 16384, "new": 256}
#: what its call may add to the resident set at most: a quarter of the context's expanded k_nope
#: and v in fp32 (256 MiB); the call's blocks, state and fp32 weight come to about 26 MiB
MEMORY_BOUND = 64 << 20

MEMORY_SNIPPET = r"""
import json
from pathlib import Path

import torch

from zen_mla.attention.latent import latent_attention

torch.set_num_threads(2)
h, tk, tq = {heads}, {context}, {new}


def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


def peak(fn):
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status("VmHWM")
    fn()
    return status("VmHWM") - before


def inputs(tq, tk):
    def randn(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16)

    cu = lambda n: torch.tensor([0, n])
    return randn(tq, h, 192), randn(tk, 512), randn(tk, 64), randn(h * 256, 512), cu(tq), cu(tk)


latent_attention(*inputs(64, 300), form="expand")  # the threads and the BLAS come up first
args = inputs(tq, tk)
print(json.dumps({{
    "expand": peak(lambda: latent_attention(*args, return_lse=True, form="expand")),
    "expanded_kv": peak(lambda: torch.empty(tk, h * 256).fill_(1.0)),
}}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's /proc only")
def test_expand_form_never_holds_the_expanded_context():
    """A fresh process's peak resident growth over one expand call, the context's whole
    expansion measured the same way beside it (so the measurement is seen to see it)."""
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_SNIPPET.format(**MEMORY_CASE)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
        # no spinning between the matmuls, which costs a shared host's other work dearly; glibc's
        # mmap threshold held at 128 KiB, so that the call's blocks are fresh pages, never those
        # the warm-up freed (the threshold otherwise rises to the largest block freed)
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "MALLOC_MMAP_THRESHOLD_": "131072"},
    )
    grew = json.loads(done.stdout.strip().splitlines()[-1])
    whole = MEMORY_CASE["context"] * MEMORY_CASE["heads"] * 256 * 4
    assert grew["expanded_kv"] >= 0.9 * whole
    assert grew["expand"] <= MEMORY_BOUND, f"{grew['expand'] / 2**20:.1f} MiB"
