"""The LSE path on zentorch: its start-up probe, the fallback to torch where the probe fails,
callers under inference mode, and the merge property the LSE exists for."""

from __future__ import annotations

import pytest
import torch

import zen_mla
from tests.attention.kernels_ran import kernels_ran
from tests.reference import assert_close_to_reference, attention_fp64
from zen_mla.attention import probes
from zen_mla.attention.kernels import zentorch as zentorch_kernel
from zen_mla.attention.status import host_status

pytestmark = pytest.mark.zentorch

MLA = (4, 192, 128)


def _batch(q_lens, kv_lens, heads=MLA, dtype=torch.bfloat16, seed=0):
    h, dqk, dv = heads
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), h, dqk, generator=gen).to(dtype)
    k = torch.randn(sum(kv_lens), h, dqk, generator=gen).to(dtype)
    v = torch.randn(sum(kv_lens), h, dv, generator=gen).to(dtype)
    q_cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    kv_cu = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()])
    return q, k, v, q_cu, kv_cu


def test_the_probe_passes_here_and_auto_lse_runs_zentorch_where_it_won():
    status = zen_mla.host_kernels()
    lse = status["auto"]["lse"]
    if not host_status().sdpa_lse_ok:
        pytest.skip(f"zentorch's LSE route failed its probe here: {lse['reason']}")
    assert status["zentorch"]["ops"]["zentorch_sdpa_lse"]
    assert zen_mla.kernel_choice("zentorch", return_lse=True).lse == "zentorch"
    if lse["kernel"] != "zentorch":
        pytest.skip(f"auto with an LSE is {lse['kernel']} here: {lse['reason']}")
    assert zen_mla.kernel_choice("auto", return_lse=True) == zen_mla.KernelChoice(
        "zentorch", "zentorch"
    )
    q, k, v, q_cu, kv_cu = _batch([64, 7, 30], [64, 40, 10])
    (out, lse), ran = kernels_ran(
        lambda: zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, return_lse=True)
    )
    assert ran == {"zentorch"}
    assert_close_to_reference(q, k, v, q_cu, kv_cu, True, out, lse)


def _default_second_return_is_the_lse() -> bool:
    """Whether the op's second return, called as `out` without an LSE calls it, holds the
    natural-log LSE on this CPU, judged against fp64 without zen_mla's probe: ZenDNN's direct
    route (Zen 4 and later, AVX-512) leaves it uninitialised; where zentorch runs torch's flash
    loop (Zen 2 / Zen 3, AVX2) it is the true LSE."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=gen).bfloat16() for _ in range(3))
    with torch.inference_mode():
        _, second = zentorch_kernel.zentorch_op()(q, k, v, 0.0, True, scale=0.125)
    scores = torch.einsum("nhid,nhjd->nhij", q.double(), k.double()) * 0.125
    scores.masked_fill_(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.logsumexp(scores, dim=-1)
    return second.shape == want.shape and bool((second.double() - want).abs().max() < 1e-3)


def test_the_probe_judges_the_ops_default_second_return_by_what_it_holds(monkeypatch):
    """Without the route, the op's second return is uninitialised memory where ZenDNN computes
    (caught), and the real LSE where zentorch runs torch's loop (passed): the probe's verdict
    follows what the return holds on this CPU, found here against fp64 on its own."""

    def default_call(call):
        return zentorch_kernel.zentorch_sdpa(call)

    holds_the_lse = _default_second_return_is_the_lse()
    monkeypatch.setattr(zentorch_kernel, "zentorch_sdpa_with_lse", default_call)
    verdict = probes.probe_lse()
    if holds_the_lse:
        assert verdict is None
    else:
        assert verdict is not None and "zentorch_sdpa's LSE route" in verdict


def test_the_probe_rejects_a_route_that_raises(monkeypatch):
    def raising(*args, **kwargs):
        raise RuntimeError("sdpa_flash_cpu: unsupported")

    monkeypatch.setattr(zentorch_kernel, "zentorch_sdpa_with_lse", raising)
    assert "raised" in probes.probe_lse()


def test_the_probe_rejects_an_lse_off_by_more_than_1e_3(monkeypatch):
    real = zentorch_kernel.zentorch_sdpa_with_lse

    def off(call):
        out, lse = real(call)
        return out, lse + 2e-3

    monkeypatch.setattr(zentorch_kernel, "zentorch_sdpa_with_lse", off)
    assert "disagrees with fp64" in probes.probe_lse()


def test_where_the_probe_fails_lse_requests_run_on_torch_and_say_so(monkeypatch):
    monkeypatch.setattr(probes, "probe_lse", lambda: "the LSE was off by 3")
    probed = probes.probe_host_facts()
    monkeypatch.setattr(probes, "host_facts", lambda: probed)
    status = zen_mla.host_kernels()
    assert not status["zentorch"]["ops"]["zentorch_sdpa_lse"]
    fallback = status["auto"]["lse"]["kernel"]  # of native and torch, the one measured faster
    assert fallback == ("torch" if probed.native_failure else fallback) != "zentorch"
    if fallback == "torch" and status["auto"]["out"]["kernel"] == "zentorch":
        assert status["auto"]["lse"]["reason"].startswith(
            f"{probed.native_failure}; the LSE was off by 3"
        )
    assert zen_mla.kernel_choice("zentorch", return_lse=True) == zen_mla.KernelChoice(
        fallback, fallback
    )
    assert zen_mla.kernel_choice("zentorch").out == "zentorch"
    q, k, v, q_cu, kv_cu = _batch([33, 5], [33, 20])
    (out, lse), ran = kernels_ran(
        lambda: zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, return_lse=True, kernel="zentorch")
    )
    assert ran == {fallback}
    assert_close_to_reference(q, k, v, q_cu, kv_cu, True, out, lse)
    _, ran = kernels_ran(lambda: zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, kernel="zentorch"))
    assert ran == {"zentorch"}


@pytest.mark.parametrize("heads", [MLA, (2, 64, 64)], ids=["mla_192_128", "equal_64"])
def test_callers_under_inference_mode(heads):
    """vLLM runs models under torch.inference_mode(); the route needs a tensor that can
    require grad, which inference tensors cannot."""
    q, k, v, q_cu, kv_cu = _batch([40, 9, 0, 3], [40, 30, 5, 0], heads)
    with torch.inference_mode():
        q, k, v = q.clone(), k.clone(), v.clone()
        (out, lse), ran = kernels_ran(
            lambda: zen_mla.ragged_attention(
                q, k, v, q_cu, kv_cu, return_lse=True, kernel="zentorch"
            )
        )
    assert q.is_inference() and ran == {zen_mla.kernel_choice("zentorch", return_lse=True).out}
    assert_close_to_reference(q, k, v, q_cu, kv_cu, True, out, lse)


def test_outputs_carry_no_autograd_graph():
    q, k, v, q_cu, kv_cu = _batch([16], [16])
    out, lse = zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, return_lse=True, kernel="zentorch")
    assert not out.requires_grad and out.grad_fn is None
    assert not lse.requires_grad and lse.grad_fn is None
    assert torch.isfinite(lse).all() and not out.isnan().any()


def test_fp32_inputs_on_the_route_are_fp32_accurate():
    q, k, v, q_cu, kv_cu = _batch([50, 3], [70, 3], dtype=torch.float32)
    out, lse = zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, return_lse=True, kernel="zentorch")
    ref_out, ref_lse = attention_fp64(
        q, k, v, q_cu.tolist(), kv_cu.tolist(), causal=True, scale=192**-0.5
    )
    assert (lse.double() - ref_lse).abs().max().item() < 1e-4
    assert (out.double() - ref_out).abs().max().item() < 1e-4
