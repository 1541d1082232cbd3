"""PrefillEngine over MLA's latent cache: a batch of q, kv_c, k_pe and the layer's w_kv_b run on
real workers, split by heads (each piece takes its heads' rows of the weight), equal to
in-process `latent_attention` and to the fp64 expanded reference; inputs and a weight lying in
the engine's shared buffers read in place; the errors that name the tensor, before the pool."""

from __future__ import annotations

import pytest
import torch

import zen_mla
from tests.reference import attention_fp64
from zen_mla.attention import latent
from zen_mla.attention.latent import latent_attention
from zen_mla.engine import EngineConfig, PrefillEngine
from zen_mla.pool import PoolConfig
from zen_mla.wire import PrefillOptions

H, RANK, ROPE, NOPE, DV = 4, 64, 16, 32, 24
Q_LENS, KV_LENS = [3, 0, 40, 9], [50, 6, 40, 9]


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _latent(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(Q_LENS), sum(KV_LENS)
    return {
        "q": torch.randn(tq, H, NOPE + ROPE, generator=gen).to(dtype),
        "kv_c": torch.randn(tk, RANK, generator=gen).to(dtype),
        "k_pe": torch.randn(tk, ROPE, generator=gen).to(dtype),
        "w_kv_b": (torch.randn(H * (NOPE + DV), RANK, generator=gen) / RANK**0.5).to(dtype),
        "q_cu_seq_lens": _cu(Q_LENS),
        "kv_cu_seq_lens": _cu(KV_LENS),
    }


def _reference(x: dict[str, torch.Tensor], causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64: every context key and value expanded from the latent, then softmax attention."""
    w = x["w_kv_b"].double().view(H, NOPE + DV, RANK)
    kv_c = x["kv_c"].double()
    k_nope = torch.einsum("tr,hdr->thd", kv_c, w[:, :NOPE])
    k_pe = x["k_pe"].double()[:, None].expand(-1, H, ROPE)
    v = torch.einsum("tr,hdr->thd", kv_c, w[:, NOPE:])
    return attention_fp64(
        x["q"],
        torch.cat([k_nope, k_pe], dim=-1),
        v,
        x["q_cu_seq_lens"].tolist(),
        x["kv_cu_seq_lens"].tolist(),
        causal=causal,
        scale=(NOPE + ROPE) ** -0.5,
    )


@pytest.fixture(scope="module")
def engine():
    # pieces as small as one head: a batch is spread over both workers by heads
    config = EngineConfig(PoolConfig(workers=2, heartbeat_interval=0.2, min_piece_cost=1))
    with PrefillEngine(config) as e:
        yield e


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("form", ["expand", "absorb", "auto"])
def test_a_latent_batch_on_the_workers_is_latent_attention(engine, form, causal):
    x = _latent()
    request = engine.prepare(x, PrefillOptions(causal=causal, return_lse=True, form=form))
    assert request.kernels == zen_mla.KernelChoice("latent", "latent")
    assert (request.num_seqs, request.num_q_tokens, request.num_kv_tokens) == (4, 52, 105)
    assert request.cost.work == latent.work(request.batch, form, precision="auto", return_lse=True)
    assert request.cost.workspace_bytes >= latent.workspace_bytes(request.batch, threads=1) > 0
    result = engine.run(request).result(timeout=60)
    try:
        here, here_lse = latent_attention(**x, causal=causal, return_lse=True, form=form)
        # the workers ran the same code on heads apart: equal within a rounding of bf16
        assert (result.out.float() - here.float()).abs().max().item() <= 2**-6
        assert (result.lse - here_lse).abs().max().item() <= 1e-4
        ref_out, ref_lse = _reference(x, causal)
        assert (result.out.double() - ref_out).abs().max().item() <= 2e-2
        assert result.lse is not None
        seen = ~torch.isinf(ref_lse)
        assert torch.equal(torch.isneginf(result.lse), ~seen)
        assert (result.lse.double() - ref_lse)[seen].abs().max().item() <= 1e-3
        assert result.kernels.out == "latent"
    finally:
        result.release()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_precision_asked_is_the_workers(engine, precision):
    """`PrefillOptions.precision` reaches the workers: the LSE as in-process `latent_attention`
    gives it in that precision (bf16's rounding of the keys moves it ~1e-3 where the CPU has
    bf16 arithmetic, against "auto"'s correction)."""
    x = _latent(seed=3)
    options = PrefillOptions(return_lse=True, form="expand", precision=precision)
    request = engine.prepare(x, options)
    want = latent.work(request.batch, "expand", precision=precision, return_lse=True)
    assert request.cost.work == want
    result = engine.run(request).result(timeout=60)
    try:
        here, here_lse = latent_attention(**x, return_lse=True, form="expand", precision=precision)
        assert (result.out.float() - here.float()).abs().max().item() <= 2**-6
        assert result.lse is not None
        assert (result.lse - here_lse).abs().max().item() <= 1e-5
    finally:
        result.release()


def test_inputs_and_a_weight_in_shared_buffers_are_read_in_place(engine):
    """The request's tensors in one buffer (a body read from a socket), the weight in another
    (registered once): the workers map both, nothing is copied into a staging buffer."""
    x = _latent(seed=1)
    body = engine.buffer(sum(x[n].nbytes for n in ("q", "kv_c", "k_pe")) + 3 * 64)
    weight = engine.buffer(x["w_kv_b"].nbytes)
    try:
        placed = dict(x)
        at = 0
        for name in ("q", "kv_c", "k_pe"):
            t = body.tensor(at, tuple(x[name].shape), x[name].dtype)
            t.copy_(x[name])
            placed[name] = t
            at += -(-x[name].nbytes // 64) * 64
        placed["w_kv_b"] = weight.tensor(0, tuple(x["w_kv_b"].shape), x["w_kv_b"].dtype)
        placed["w_kv_b"].copy_(x["w_kv_b"])
        request = engine.prepare(placed, PrefillOptions(form="expand"))
        result = engine.run(request, inputs=[body, weight]).result(timeout=60)
        try:
            want = latent_attention(**x, form="expand")
            assert (result.out.float() - want.float()).abs().max().item() <= 2**-6
        finally:
            result.release()
    finally:
        engine.release(body)
        engine.release(weight)


@pytest.mark.parametrize(
    ("change", "options", "name", "expected"),
    [
        (lambda x: x.pop("w_kv_b"), {}, "w_kv_b", "a tensor of that name"),
        (lambda x: x.update(k=x["kv_c"]), {}, "k", "no k or v beside kv_c"),
        (lambda x: None, {"form": "fold"}, "form", '"expand", "absorb" or "auto"'),
        (lambda x: None, {"precision": "fp8"}, "precision", '"auto", "bf16" or "fp32"'),
        (lambda x: x.update(k_pe=x["k_pe"][:-1]), {}, "k_pe", "[Tk=105, rope_dim]"),
        (lambda x: x.update(w_kv_b=x["w_kv_b"].T), {}, "w_kv_b", "[H * (qk_nope_dim"),
    ],
    ids=[
        "no_weight",
        "k_beside_kv_c",
        "unknown_form",
        "unknown_precision",
        "k_pe_short",
        "weight_transposed",
    ],
)
def test_a_bad_latent_request_is_refused_naming_the_tensor(engine, change, options, name, expected):
    x = _latent()
    change(x)
    with pytest.raises(zen_mla.InvalidInputError) as info:
        engine.prepare(x, PrefillOptions(**options))
    assert info.value.name == name and expected in info.value.expected


def test_latent_work_over_the_cap_is_refused_before_the_pool():
    x = _latent()
    request_work = None
    config = EngineConfig(PoolConfig(workers=1), max_work=1000)
    engine = PrefillEngine(config)  # never started: the refusal comes before any worker
    try:
        with pytest.raises(zen_mla.WorkTooLargeError) as info:
            engine.prepare(x, PrefillOptions(form="absorb"))
        request_work = int(info.value.got)
    finally:
        engine.close()
    assert request_work > 1000
