"""zen_mla.vllm in process (`ZEN_MLA_URL=local`): the settings, the backend computing every call
with zen-mla's kernels in this process (the numbers `ragged_attention` gives, `out` written in
place, context chunks, a step with context at once), and the plugin's lines. Real vLLM running
it: tests/vllm_engine/test_engine.py."""

from __future__ import annotations

import logging
import threading
import types

import pytest
import torch

import zen_mla
from zen_mla import vllm
from zen_mla.vllm import ContextKV, LocalSettings, RemoteSettings, settings_from_env


def backend(settings: LocalSettings, num_heads: int = 4, scale: float = 0.25):
    return vllm.backend_class()(num_heads, scale, 16, 16, 0, 16, None, settings=settings)


class _Meta:
    query_start_loc = torch.tensor([0, 3, 8], dtype=torch.int32)


def _qkv(t: int = 8, h: int = 4, dqk: int = 24, dv: int = 16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(t)
    return (
        torch.randn(t, h, dqk, generator=g).to(dtype),
        torch.randn(t, h, dqk, generator=g).to(dtype),
        torch.randn(t, h, dv, generator=g).to(dtype),
    )


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"ZEN_MLA_URL": "local"}, LocalSettings("auto")),
        ({"ZEN_MLA_URL": " Local "}, LocalSettings("auto")),
        ({"ZEN_MLA_URL": "local", "ZEN_MLA_KERNEL": "torch"}, LocalSettings("torch")),
        (
            {"ZEN_MLA_URL": "http://a:1", "ZEN_MLA_KERNEL": "torch"},
            RemoteSettings(urls=("http://a:1",)),
        ),
    ],
    ids=["local", "spelled_loosely", "kernel", "a_url_keeps_the_service"],
)
def test_settings_from_the_environment(env, want):
    assert settings_from_env(env) == want


def test_a_kernel_that_does_not_exist_is_refused_naming_the_variable():
    with pytest.raises(zen_mla.InvalidInputError, match="ZEN_MLA_KERNEL: expected one of auto"):
        settings_from_env({"ZEN_MLA_URL": "local", "ZEN_MLA_KERNEL": "fastest"})


def test_in_process_it_is_available_and_has_no_client(monkeypatch):
    monkeypatch.setenv("ZEN_MLA_URL", "local")
    vllm.default_settings.cache_clear()
    try:
        assert vllm.backend_class().is_available()
        b = backend(vllm.default_settings())
        assert isinstance(b.link, vllm.LocalPrefiller)
        with pytest.raises(
            zen_mla.InvalidInputError, match="client: expected a backend of a service"
        ):
            _ = b.client
        assert b.clone().settings is b.settings
    finally:
        vllm.default_settings.cache_clear()


@pytest.mark.parametrize("kernel", ["auto", "torch", "reference"])
def test_new_tokens_are_ragged_attentions_numbers(kernel):
    b = backend(LocalSettings(kernel))
    b.prepare_metadata(_Meta())
    q, k, v = _qkv()
    before = vllm.stats.snapshot()
    out, lse = b.run_prefill_new_tokens(q, k, v, True)
    plain = b.run_prefill_new_tokens(q, k, v, False)
    want_out, want_lse = zen_mla.ragged_attention(
        q, k, v, _Meta.query_start_loc, return_lse=True, scale=0.25, kernel=kernel
    )
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(
        plain, zen_mla.ragged_attention(q, k, v, _Meta.query_start_loc, scale=0.25, kernel=kernel)
    )
    after = vllm.stats.snapshot()
    assert (after.local - before.local, after.remote - before.remote) == (2, 0)


def test_out_is_written_in_place_and_a_strided_v_is_taken_as_it_is():
    """vLLM's v is a view of kv_b_proj's output (`split`): rows of nope + v, v's last dim unit
    stride."""
    b = backend(LocalSettings())
    b.prepare_metadata(_Meta())
    q, k, _ = _qkv()
    kv = torch.randn(8, 4, 24 + 16).bfloat16()
    v = kv[..., 24:]
    assert not v.is_contiguous()
    out = torch.full((8, 4, 16), float("nan"), dtype=torch.bfloat16)
    assert b.run_prefill_new_tokens(q, k, v, False, out=out) is out
    assert torch.equal(
        out, zen_mla.ragged_attention(q, k, v.contiguous(), _Meta.query_start_loc, scale=0.25)
    )


def test_a_context_chunk_and_a_step_with_context_at_once():
    b = backend(LocalSettings())
    b.prepare_metadata(_Meta())
    q, k, v = _qkv()
    ck, cv = torch.randn(9, 4, 24).bfloat16(), torch.randn(9, 4, 16).bfloat16()
    chunk = types.SimpleNamespace(
        query_start_loc=_Meta.query_start_loc, cu_seq_lens=torch.tensor([0, 0, 9])
    )
    out, lse = b.run_prefill_context_chunk(chunk, q, ck, cv)
    want_out, want_lse = zen_mla.ragged_attention(
        q,
        ck,
        cv,
        _Meta.query_start_loc,
        chunk.cu_seq_lens,
        causal=False,
        return_lse=True,
        scale=0.25,
    )
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.isneginf(lse[:, :3]).all()  # the first request has no keys in this chunk
    # the step at once, against one bottom-right causal call over context + new tokens
    threads = threading.active_count()
    merged = b.run_prefill_with_context(q, k, v, [ContextKV(ck, cv, chunk.cu_seq_lens)])
    assert threading.active_count() == threads  # computed on this thread: no pool started
    kv_cu = torch.tensor([0, 3, 3 + 9 + 5])
    whole_k = torch.cat([k[:3], ck, k[3:]])
    whole_v = torch.cat([v[:3], cv, v[3:]])
    want = zen_mla.ragged_attention(
        q, whole_k, whole_v, _Meta.query_start_loc, kv_cu, scale=0.25, kernel="reference"
    )
    assert (merged.float() - want.float()).abs().max() < 2e-2


def test_the_first_call_says_which_kernel_runs(caplog):
    vllm.LocalPrefiller._told.clear()
    b = backend(LocalSettings())
    b.prepare_metadata(_Meta())
    with caplog.at_level(logging.INFO, logger="zen_mla.vllm"):
        b.run_prefill_new_tokens(*_qkv(), False)
        b.run_prefill_new_tokens(*_qkv(), False)
    said = [r.getMessage() for r in caplog.records if "computed in this process" in r.getMessage()]
    chosen = zen_mla.kernel_choice("auto").out
    assert len(said) == 1 and f"zen-mla's kernel {chosen}" in said[0] and "auto: " in said[0], said


def test_the_plugin_says_the_prefill_is_computed_in_process(monkeypatch, vllm_registry, caplog):
    monkeypatch.setenv("ZEN_MLA_URL", "local")
    monkeypatch.setenv("ZEN_MLA_KERNEL", "torch")
    monkeypatch.setattr(vllm.plugin, "_amx", lambda: False)
    with caplog.at_level(logging.INFO, logger="zen_mla.vllm"):
        vllm.register()
    path = "zen_mla.vllm.ZenMLARemotePrefillBackend"
    assert vllm_registry.calls == [("ZEN_MLA", path), ("ZEN_CPU", path), ("CPU", path)]
    # in process, CPU_MLA attends the cached context from the latent
    assert vllm_registry.attention == [("CPU_MLA", vllm.plugin.CPU_MLA_PATH)]
    said = [r.getMessage() for r in caplog.records if r.name == "zen_mla.vllm"]
    assert "zen-mla's kernels in this process (ZEN_MLA_KERNEL=torch)" in said[0], said


def test_zen_mla_latent_0_leaves_vllms_expansion_as_it_is(monkeypatch, vllm_registry, caplog):
    """The class is registered all the same (it reads the setting at each call, in vLLM:
    tests/vllm_engine), and the plugin does not say the context is attended from the latent."""
    monkeypatch.setenv("ZEN_MLA_URL", "local")
    monkeypatch.setenv("ZEN_MLA_LATENT", "0")
    with caplog.at_level(logging.INFO, logger="zen_mla.vllm"):
        vllm.register()
    assert len(vllm_registry.calls) == 3  # the prefill backends still zen-mla's
    assert not [r for r in caplog.records if "from the latent" in r.getMessage()]
