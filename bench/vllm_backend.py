"""What the vLLM backend costs: one prefill step in process against the same step through a real
local server, called as vLLM calls a backend (one piece after another) and with the concurrent
helper (every piece at once).

    .venv/bin/python bench/vllm_backend.py [--reps 7]

Steps (H=16, Dqk=192, Dv=128, bf16):
- `chunk`: new tokens 4 x 256 (causal, LSE) and the contract's context chunk, q 4 x 256 against
  kv 4 x 2048 (non-causal, LSE), merged by LSE;
- `chunk/4`: the same context cut in four chunks of 4 x 512, as vLLM cuts it when its
  workspace is smaller than the context;
- `mixed`: the contract's batch [2048, 1024, 512, 256, 128, 64], causal, no context.

Starts its own `zen-mla serve` on a free loopback port and stops it. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
from _server import start_server

import zen_mla
from tests.prefill_steps import Step, StepSpec, make_step
from zen_mla.attention.merge import merge_attn_states, merge_many
from zen_mla.vllm import RemoteSettings, backend_class

SCALE = c.DQK**-0.5


STEPS = {
    "chunk": StepSpec([256] * 4, [[2048] * 4]),
    "chunk/4": StepSpec([256] * 4, [[512] * 4] * 4),
    "mixed": StepSpec(c.REFERENCE_BATCHES["mixed"].q_lens, []),
}


def in_process(step: Step) -> Callable[[], object]:
    """The same parts and merge, computed here by `ragged_attention` (`auto`: zentorch on Zen)."""

    def run() -> object:
        q, qc = step.q, step.query_start_loc
        if not step.context:
            return zen_mla.ragged_attention(q, step.k, step.v, qc, scale=SCALE)
        parts = [zen_mla.ragged_attention(q, step.k, step.v, qc, return_lse=True, scale=SCALE)]
        for ctx in step.context:
            parts.append(
                zen_mla.ragged_attention(
                    q, ctx.k, ctx.v, qc, ctx.cu_seq_lens, causal=False, return_lse=True, scale=SCALE
                )
            )
        return merge_many([o for o, _ in parts], [lse for _, lse in parts])

    return run


class _Chunk:
    def __init__(self, query_start_loc: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
        self.query_start_loc, self.cu_seq_lens = query_start_loc, cu_seq_lens


class _Meta:
    def __init__(self, query_start_loc: torch.Tensor) -> None:
        self.query_start_loc = query_start_loc


def sequential(b: Any, step: Step) -> Callable[[], object]:
    """vLLM's flow: new tokens, then each context chunk, folded by merge_attn_states."""

    def run() -> object:
        b.prepare_metadata(_Meta(step.query_start_loc))
        if not step.context:
            return b.run_prefill_new_tokens(step.q, step.k, step.v, False)
        out, lse = b.run_prefill_new_tokens(step.q, step.k, step.v, True)
        for ctx in step.context:
            chunk = _Chunk(step.query_start_loc, ctx.cu_seq_lens)
            c_out, c_lse = b.run_prefill_context_chunk(chunk, step.q, ctx.k, ctx.v)
            merged, merged_lse = torch.empty_like(out), torch.empty_like(lse)
            merge_attn_states(merged, c_out, c_lse, out, lse, merged_lse)
            out, lse = merged, merged_lse
        return out, lse

    return run


def concurrent(backend: Any, step: Step) -> Callable[[], object]:
    def run() -> object:
        backend.prepare_metadata(_Meta(step.query_start_loc))
        return backend.run_prefill_with_context(step.q, step.k, step.v, step.context, True)

    return run


def mib_sent(step: Step) -> float:
    """Tensor bytes the backend sends for a step: q goes again with every context chunk."""
    nbytes = sum(t.nbytes for t in (step.q, step.k, step.v))
    nbytes += sum(step.q.nbytes + ctx.k.nbytes + ctx.v.nbytes for ctx in step.context)
    return nbytes / 2**20


def cpu_name() -> str:
    status = zen_mla.host_kernels()["cpu"]
    family = status.get("family")
    zen = {23: "Zen 1/2", 25: "Zen 3/4", 26: "Zen 5"}.get(family, f"family {family}")
    return f"{status['model']} ({status['vendor']}, {zen if status.get('zen') else 'not Zen'})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    proc, url = start_server("httptools")
    try:
        backend = backend_class()(
            c.H, SCALE, 512, 128, 64, c.DV, None, settings=RemoteSettings(urls=(url,))
        )
        workers = len(httpx.get(url + "/health").json()["workers"])
        rows = []
        for name, spec in STEPS.items():
            step = make_step(spec, (c.H, c.DQK, c.DV), torch.bfloat16)
            fns = {
                "in-process ragged_attention": in_process(step),
                "backend, sequential (vLLM's calls)": sequential(backend, step),
            }
            if step.context:
                fns["backend, concurrent helper"] = concurrent(backend, step)
            medians = c.paired_medians(fns, args.reps)
            base = medians["in-process ragged_attention"]
            for method, seconds in medians.items():
                sent = "-" if method.startswith("in-process") else f"{mib_sent(step):.0f}"
                rows.append([name, method, sent, f"{seconds * 1e3:.2f}", f"{seconds / base:.2f}x"])
        choice = zen_mla.kernel_choice("auto", torch.bfloat16, return_lse=True)
        print(
            f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} CPUs shared by the client and "
            f"the server ({workers} worker(s)); in process: out on {choice.out}, "
            f"LSE on {choice.lse}; medians of {args.reps} interleaved runs\n"
        )
        print(c.table(["step", "method", "MiB sent", "median ms", "vs in-process"], rows))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
