"""One row of bench/vllm_ttft.py: vLLM's engine in this process (.venv-vllm's Python), on the
model and in the mode its environment says (`ZEN_MLA_URL` unset, `local` or a service's URL;
`VLLM_CPU_OMP_THREADS_BIND`), warmed up, then measuring the prompts it is sent on stdin, one JSON
line each, `RESULT {...}` on stdout.

    python -c "import sys, _ttft_engine; _ttft_engine.main(*sys.argv[1:])" ROW MODEL LONGEST CACHED
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["BLOCK", "cpu_mla_is_default", "main", "prompt_ids"]

BLOCK = 16  # vLLM's CPU MLA block size
WARM_UP = 256  # tokens of the warm-up prompt, and of the warm-up's cached prefix and question


def prompt_ids(tokens: int, rep: int, vocab: int, column: str = "fresh") -> list[int]:
    """Random token ids (never 0 or 1, bos and eos), the same for a (column, tokens, rep)."""
    rng = random.Random(f"{column}-{tokens}-{rep}")
    return [rng.randrange(2, vocab) for _ in range(tokens)]


class Timers:
    """Seconds spent in the prefill backend's calls, in zen-mla's kernel and in the cached
    context's part of the prefill during one `generate`, by wrapping the methods vLLM calls
    (the engine runs in this process)."""

    def __init__(self, row: str) -> None:
        self.attention = self.kernel = self.context = 0.0
        self.calls = 0
        if row == "default" and not cpu_mla_is_default():
            return  # AMX_MLA's prefill calls no prefill backend
        # the cached context's whole part (gather, expansion or the latent, its attention), on
        # the class the row's engine runs (zen-mla's, in process or through the service, calls
        # vLLM's where it expands)
        if row not in ("default", "cpu_mla"):
            from zen_mla.vllm.cpu_mla import ZenCPUMLAImpl

            self._wrap_function(ZenCPUMLAImpl, "_compute_prefill_context", "context")
        else:
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

            self._wrap_function(CPUMLAImpl, "_compute_prefill_context", "context")
        if row in ("default", "cpu_mla"):
            from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

            self._wrap(CPUSDPAMLAPrefillBackend, "attention")
            return
        import zen_mla
        import zen_mla.vllm

        self._wrap(zen_mla.vllm.backend_class(), "attention")
        self._wrap_function(zen_mla, "ragged_attention", "kernel")

    def _wrap(self, cls: type, into: str) -> None:
        for name in ("run_prefill_new_tokens", "run_prefill_context_chunk"):
            self._wrap_function(cls, name, into)

    def _wrap_function(self, owner: Any, name: str, into: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, into, getattr(self, into) + time.perf_counter() - t0)
                self.calls += into == "attention"

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        got = {
            "attention": self.attention,
            "kernel": self.kernel,
            "context": self.context,
            "calls": self.calls,
        }
        self.attention = self.kernel = self.context = 0.0
        self.calls = 0
        return got


def cpu_mla_is_default() -> bool:
    """Whether vLLM's CPU platform picks CPU_MLA here by default: the CPU has no AMX tiles (vLLM's
    own test, `torch.cpu._is_amx_tile_supported`)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return not (probe is not None and probe())


def main(row: str, model: str, longest: str, cached: str) -> None:
    """One row: its engine (`row` of bench/vllm_ttft.py's ROWS), prompts of up to `longest`
    tokens, a PrefixConnector where `cached` is not "0" and the engine keeps no prefix cache of
    its own; one JSON line per measurement on stdout."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # LLM builds its attention config before vLLM loads plugins
    config = json.loads((Path(model) / "config.json").read_text())
    vocab = config["vocab_size"]
    kwargs: dict[str, Any] = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=int(longest) + BLOCK,
        max_num_seqs=1,
        gpu_memory_utilization=0.2,
        seed=0,
    )
    if row != "default":
        kwargs["attention_config"] = {"backend": "CPU_MLA"}
    keeps_prefixes = row == "default" and not cpu_mla_is_default()  # AMX_MLA's cache
    stored = tempfile.TemporaryDirectory(prefix="zen-mla-prefixes-")  # gone with this process
    if cached != "0" and not keeps_prefixes:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PrefixConnector",
            kv_connector_module_path="_prefix_connector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": stored.name},
        )
    llm = LLM(**kwargs)
    timers = Timers(row)
    greedy = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, detokenize=False)

    def generate(ids: list[int]) -> tuple[float, int, float]:
        t0 = time.perf_counter()
        (result,) = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)
        seconds = time.perf_counter() - t0
        token = result.outputs[0].token_ids[0]
        return seconds, token, result.outputs[0].logprobs[0][token].logprob

    generate(prompt_ids(256, 0, vocab, "warm-up"))
    if "kv_transfer_config" in kwargs:
        # the cached context's path too, so that no measured prompt pays for its first call
        # (through the service: the layers' weights hashed and registered)
        ids = prompt_ids(2 * WARM_UP, 0, vocab, "warm-up-cached")
        generate(ids[: WARM_UP + 1])
        generate(ids)
    timers.take()
    print("READY", flush=True)
    for request in sys.stdin:  # {"column", "tokens", "rep"}: one measurement each
        asked = json.loads(request)
        ids = prompt_ids(asked["tokens"], asked["rep"], vocab, asked["column"])
        if asked["column"] in ("cached", "prefix"):
            # kept: its first half ("cached"), or all but its last `new` tokens ("prefix")
            kept = (
                asked["tokens"] // 2
                if asked["column"] == "cached"
                else asked["tokens"] - asked["new"]
            )
            generate(ids[: kept // BLOCK * BLOCK + 1])
            timers.take()
        seconds, token, logprob = generate(ids)
        line = asked | {"ttft": seconds, "token": token, "logprob": logprob, **timers.take()}
        print("RESULT " + json.dumps(line), flush=True)
