"""vLLM's engine with zen-mla installed and ZEN_MLA_URL set, nothing else: its MLA prefill goes
to a real zen-mla server, or to zen-mla's kernels in the engine's process (`ZEN_MLA_URL=local`),
agrees call by call with vLLM's own CPU backend on the same tensors, its cached context attended
from the latent agrees layer by layer with vLLM's expansion, and it survives the server going
away."""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

import zen_mla.vllm as zen_vllm
from tests.processes import wait_for
from tests.service.restart import kill, requests_answered, serve_on
from tests.vllm_engine.recording import record

OUT_ATOL = 1e-4  # fp32 in and out; measured ~3e-6
LSE_ATOL = 1e-4
LAYERS = 2  # tiny_model.CONFIG: one prefill call per layer per step and piece
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
# one prompt per generate() and longer than a block (16): vLLM's own backend fails otherwise in
# the connector pass (`assert seq_lens` in mla_attention.py)
PROMPT = {"prompt_token_ids": list(range(2, 42))}


# As docs/vllm.md tells AMX hosts: vLLM's CPU platform picks AMX_MLA wherever the CPU has AMX
# (platforms/cpu.py, get_attn_backend_cls), whose prefill calls no prefill backend and which
# refuses the tiny model's fp32 weights ("expect weight to be bfloat16"); CPU_MLA named here is
# what the platform picks anyway on a CPU without AMX (and the block size it sets is the same).
ATTENTION = {"backend": "CPU_MLA"}


def connector(tmp_path: Path) -> KVTransferConfig:
    """vLLM's ExampleConnector: stores the prompt's KV on the first pass and loads all but the
    last block on the next ones, whose prefill then runs over a context chunk."""
    return KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path / "kv")},
    )


def engine(model: Path, **kwargs: Any) -> LLM:
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=2,
        gpu_memory_utilization=0.2,
        seed=0,
        attention_config=ATTENTION,
        **kwargs,
    )


@pytest.fixture
def closing() -> Iterator[list[LLM]]:
    engines: list[LLM] = []
    yield engines
    engines.clear()
    gc.collect()


def generate(llm: LLM) -> list[int]:
    (result,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    tokens = list(result.outputs[0].token_ids)
    assert len(tokens) == GREEDY.max_tokens
    return tokens


def against_expansion(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    """Wraps `ZenCPUMLAImpl._compute_prefill_context` so that each layer's context (from the
    latent where zen-mla takes it) is also computed by vLLM's own expanding path on the same
    tensors (its chunk goes to zen-mla's prefill backend); returns the differences, (max |out|,
    max |lse|) a call, as they come."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from zen_mla.vllm.cpu_mla import ZenCPUMLAImpl

    latent = ZenCPUMLAImpl._compute_prefill_context
    diffs: list[tuple[float, float]] = []

    def compared(impl: Any, *args: Any) -> Any:
        out, lse = latent(impl, *args)
        want, want_lse = CPUMLAImpl._compute_prefill_context(impl, *args)  # vLLM expands
        diffs.append((float((out - want).abs().max()), float((lse - want_lse).abs().max())))
        return out, lse

    monkeypatch.setattr(ZenCPUMLAImpl, "_compute_prefill_context", compared)
    return diffs


def report(name: str, worst: tuple[float, float], calls: int) -> None:
    print(
        f"\nzen-mla vs vLLM's CPU backend, {name}: {calls} calls, max |out| diff "
        f"{worst[0]:.2e}, max |lse| diff {worst[1]:.2e}"
    )


def test_prefill_without_context_goes_to_the_service_and_agrees_with_vllm(
    tiny_model, zen_mla_url, tmp_path, monkeypatch, closing
):
    with serve_on(int(zen_mla_url.rsplit(":", 1)[1]), tmp_path / "server.log") as server:
        llm = engine(tiny_model)
        closing.append(llm)
        recording = record(monkeypatch)
        generate(llm)
        llm.generate([{"prompt_token_ids": list(range(7, 30))}], GREEDY, use_tqdm=False)
        calls = recording.of("new_tokens")
        assert len(calls) == 2 * LAYERS and recording.of("context_chunk") == []
        assert requests_answered(server, len(calls)) == len(calls)  # none computed elsewhere
    out_diff, _ = recording.worst()
    report("prefill without context (fp32)", recording.worst(), len(calls))
    assert out_diff <= OUT_ATOL


def test_context_chunks_go_to_the_service_and_agree_with_vllm(
    tiny_model, zen_mla_url, tmp_path, monkeypatch, closing
):
    """With `ZEN_MLA_LATENT=0` vLLM expands the cached context and hands it to zen-mla's prefill
    backend: new tokens with LSE, then one context chunk, per layer, all by the service."""
    monkeypatch.setenv("ZEN_MLA_LATENT", "0")
    with serve_on(int(zen_mla_url.rsplit(":", 1)[1]), tmp_path / "server.log") as server:
        llm = engine(tiny_model, kv_transfer_config=connector(tmp_path))
        closing.append(llm)
        recording = record(monkeypatch)
        generate(llm)  # stores
        generate(llm)  # loads: new tokens with LSE, then one context chunk, per layer
        chunks = recording.of("context_chunk")
        assert len(chunks) == LAYERS, recording.calls
        assert requests_answered(server, len(recording.calls)) == len(recording.calls)
    report("new tokens, no context", recording.worst("new_tokens"), len(recording.calls) - LAYERS)
    report("context chunks", recording.worst("context_chunk"), len(chunks))
    out_diff, lse_diff = recording.worst()
    assert out_diff <= OUT_ATOL and lse_diff <= LSE_ATOL


def test_in_process_every_call_runs_in_zen_mlas_kernel_and_agrees_with_vllm(
    tiny_model, monkeypatch, tmp_path, closing
):
    """`ZEN_MLA_URL=local`, nothing else: new tokens, then (the second pass of vLLM's
    ExampleConnector) new tokens with LSE and a context chunk, per layer, all computed here;
    the context attended from the latent (`cpu_mla`: vLLM never expands it), each layer's
    answer compared with vLLM's own expanding path on the same tensors (whose chunk goes to
    zen-mla's prefill backend, itself compared with vLLM's CPU backend)."""
    monkeypatch.setenv("ZEN_MLA_URL", "local")
    zen_vllm.default_settings.cache_clear()
    diffs = against_expansion(monkeypatch)
    try:
        llm = engine(tiny_model, kv_transfer_config=connector(tmp_path))
        closing.append(llm)
        recording = record(monkeypatch)
        before = zen_vllm.stats.snapshot()
        generate(llm)  # stores
        generate(llm)  # loads: new tokens with LSE, then one context chunk, per layer
        after = zen_vllm.stats.snapshot()
    finally:
        zen_vllm.default_settings.cache_clear()
    assert len(diffs) == LAYERS and after.latent - before.latent == LAYERS
    print(f"\nthe latent against vLLM's expansion, context chunks: {diffs}")
    assert all(o <= OUT_ATOL and s <= LSE_ATOL for o, s in diffs)
    assert len(recording.of("context_chunk")) == LAYERS, recording.calls  # the expanded ones
    assert len(recording.of("new_tokens")) == 2 * LAYERS
    # new tokens twice, the latent chunk and the expanded one (the comparison's), per layer
    assert (after.local - before.local, after.remote - before.remote) == (4 * LAYERS, 0)
    report("in process, new tokens", recording.worst("new_tokens"), 2 * LAYERS)
    report("in process, context chunks", recording.worst("context_chunk"), LAYERS)
    out_diff, lse_diff = recording.worst()
    assert out_diff <= OUT_ATOL and lse_diff <= LSE_ATOL


def holds_weights(server: Any, nbytes: int) -> bool:
    """Whether the service holds weights of `nbytes` bytes, every caller's (`/health`'s
    `held_bytes.weight`, each weight charged its bytes and its body's header; the engine's
    client registers them over HTTP or on the region socket, as a caller other than a test's
    request)."""
    held = int(server.health()["held_bytes"].get("weight", 0))
    return nbytes <= held < nbytes + LAYERS * 1024


def test_through_the_service_the_context_is_attended_from_the_latent_and_agrees_with_vllm(
    tiny_model, zen_mla_url, tmp_path, monkeypatch, closing
):
    """ZEN_MLA_URL a real server's: each layer's `kv_b_proj` weight registered with the service
    and its context chunk sent as the latent (`prefill_latent`: vLLM never expands it), each
    layer's answer compared with vLLM's own expanding path on the same tensors; the server
    killed, the link computes the latent here with the weight it holds; the server started
    again, the weights are registered with it again and the latent goes there."""
    port = int(zen_mla_url.rsplit(":", 1)[1])
    diffs = against_expansion(monkeypatch)
    cfg = json.loads((tiny_model / "config.json").read_text())
    heads, rank = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    # a kv_b_proj weight a layer, [H * (Dn + Dv), R] fp32
    held = LAYERS * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) * rank * 4
    with serve_on(port, tmp_path / "server.log") as server:
        llm = engine(tiny_model, kv_transfer_config=connector(tmp_path))
        closing.append(llm)
        recording = record(monkeypatch)
        before = zen_vllm.stats.snapshot()
        generate(llm)  # stores
        generate(llm)  # loads: new tokens with LSE, then the latent of one context chunk
        after = zen_vllm.stats.snapshot()
        # new tokens twice, the latent chunk and the expanded one (the comparison's), per layer
        assert requests_answered(server, 4 * LAYERS) == 4 * LAYERS
        assert holds_weights(server, held), server.health()["held_bytes"]
        kill(server)
    print(f"\nthe latent by the service against vLLM's expansion: {diffs}")
    assert len(diffs) == LAYERS and after.latent - before.latent == LAYERS
    assert all(o <= OUT_ATOL and s <= LSE_ATOL for o, s in diffs)
    assert (after.remote - before.remote, after.local - before.local) == (4 * LAYERS, 0)
    assert len(recording.of("context_chunk")) == LAYERS  # only the comparison's expanded ones

    before = zen_vllm.stats.snapshot()
    generate(llm)  # the server is gone: every call computed here, the latent too
    after = zen_vllm.stats.snapshot()
    assert (after.local - before.local, after.remote - before.remote) == (3 * LAYERS, 0)
    assert (after.latent - before.latent, after.outages - before.outages) == (LAYERS, 1)
    assert len(diffs) == 2 * LAYERS and all(o <= OUT_ATOL and s <= LSE_ATOL for o, s in diffs)

    with serve_on(port, tmp_path / "server.log") as again:
        link = zen_vllm.ServiceLink.of(zen_vllm.default_settings())
        wait_for(lambda: link.up, 60, lambda: "the link stayed down", 0.1)
        before = zen_vllm.stats.snapshot()
        generate(llm)
        after = zen_vllm.stats.snapshot()
        assert requests_answered(again, 3 * LAYERS) == 3 * LAYERS
        assert (after.remote - before.remote, after.latent - before.latent) == (3 * LAYERS, LAYERS)
        assert holds_weights(again, held), again.health()["held_bytes"]
    assert len(diffs) == 3 * LAYERS and all(o <= OUT_ATOL and s <= LSE_ATOL for o, s in diffs)
    out_diff, lse_diff = recording.worst()
    assert out_diff <= OUT_ATOL and lse_diff <= LSE_ATOL


def test_a_weights_name_is_its_layers_and_its_contents():
    """The name a layer's weight is registered under: in the service's alphabet and length,
    the layer's name then a digest, the same for the same weight and another for another
    weight (another model's, another rank's) of the same layer."""
    import torch

    from zen_mla.vllm.cpu_mla import weight_name
    from zen_mla.wire import check_weight_name

    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    name = weight_name("model.layers.7.self_attn.kv_b_proj", w)
    assert name.startswith("model.layers.7.self_attn.kv_b_proj-")
    assert weight_name("model.layers.7.self_attn.kv_b_proj", w.clone()) == name
    assert weight_name("model.layers.7.self_attn.kv_b_proj", w + 1) != name
    assert weight_name("model.layers.7.self_attn.kv_b_proj", w.bfloat16()) != name
    for layer in ("", "a/b c:d" * 40):
        check_weight_name("name", weight_name(layer, w))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_server_killed_between_two_generates(tiny_model, zen_mla_url, tmp_path, closing):
    """The second generate() answers from the local fallback; the link finds the restarted
    service at the same URL and the next generate() goes there again."""
    port = int(zen_mla_url.rsplit(":", 1)[1])
    lines = _Lines()
    logging.getLogger("zen_mla").addHandler(lines)
    try:
        with serve_on(port, tmp_path / "server.log") as server:
            llm = engine(tiny_model)
            closing.append(llm)
            generate(llm)
            assert requests_answered(server, LAYERS) == LAYERS
            kill(server)
        before = zen_vllm.stats.snapshot()
        generate(llm)
        after = zen_vllm.stats.snapshot()
        assert (after.local - before.local, after.remote - before.remote) == (LAYERS, 0)
        assert after.outages - before.outages == 1
        with serve_on(port, tmp_path / "server.log") as again:
            link = zen_vllm.ServiceLink.of(zen_vllm.default_settings())
            wait_for(lambda: link.up, 60, lambda: str(lines.lines), 0.1)
            generate(llm)
            assert requests_answered(again) == LAYERS
    finally:
        logging.getLogger("zen_mla").removeHandler(lines)
    print("\n" + "\n".join(f"zen-mla log: {line}" for line in lines.lines))
    print(f"zen-mla stats: {zen_vllm.stats.snapshot()}")
    assert sum("gave no answer" in line for line in lines.lines) == 1
    assert sum(f"{LAYERS} calls were computed in this process" in line for line in lines.lines) == 1
