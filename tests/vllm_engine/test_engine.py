"""vLLM's engine with zen-mla installed and ZEN_MLA_URL set, nothing else: its MLA prefill goes
to a real zen-mla server, or to zen-mla's kernels in the engine's process (`ZEN_MLA_URL=local`),
agrees call by call with vLLM's own CPU backend on the same tensors, and survives the server
going away."""

from __future__ import annotations

import gc
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
    """vLLM's ExampleConnector stores the prompt's KV on the first pass and loads all but the
    last block on the second, whose prefill then runs over a context chunk."""
    connector = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path / "kv")},
    )
    with serve_on(int(zen_mla_url.rsplit(":", 1)[1]), tmp_path / "server.log") as server:
        llm = engine(tiny_model, kv_transfer_config=connector)
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
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from zen_mla.vllm.cpu_mla import ZenCPUMLAImpl

    monkeypatch.setenv("ZEN_MLA_URL", "local")
    zen_vllm.default_settings.cache_clear()
    connector = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path / "kv")},
    )
    latent = ZenCPUMLAImpl._compute_prefill_context
    against_expanded: list[tuple[float, float]] = []

    def compared(impl: Any, *args: Any) -> Any:
        out, lse = latent(impl, *args)
        want, want_lse = CPUMLAImpl._compute_prefill_context(impl, *args)  # vLLM expands
        against_expanded.append(
            (float((out - want).abs().max()), float((lse - want_lse).abs().max()))
        )
        return out, lse

    monkeypatch.setattr(ZenCPUMLAImpl, "_compute_prefill_context", compared)
    try:
        llm = engine(tiny_model, kv_transfer_config=connector)
        closing.append(llm)
        recording = record(monkeypatch)
        before = zen_vllm.stats.snapshot()
        generate(llm)  # stores
        generate(llm)  # loads: new tokens with LSE, then one context chunk, per layer
        after = zen_vllm.stats.snapshot()
    finally:
        zen_vllm.default_settings.cache_clear()
    assert len(against_expanded) == LAYERS and after.latent - before.latent == LAYERS
    print(f"\nthe latent against vLLM's expansion, context chunks: {against_expanded}")
    assert all(o <= OUT_ATOL and s <= LSE_ATOL for o, s in against_expanded)
    assert len(recording.of("context_chunk")) == LAYERS, recording.calls  # the expanded ones
    assert len(recording.of("new_tokens")) == 2 * LAYERS
    assert (after.local - before.local, after.remote - before.remote) == (3 * LAYERS, 0)
    report("in process, new tokens", recording.worst("new_tokens"), 2 * LAYERS)
    report("in process, context chunks", recording.worst("context_chunk"), LAYERS)
    out_diff, lse_diff = recording.worst()
    assert out_diff <= OUT_ATOL and lse_diff <= LSE_ATOL


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
