"""A model step as an orchestrator runs it: 61 sequential prefill calls (one per layer, as
DeepSeek-V3 makes them) through `zen_mla.vllm`'s backend, against the same calls computed in
process, on each path the client can take to a local server.

    .venv/bin/python bench/step.py [--reps 5] [--service-cpus half]

Steps (H=16, Dqk=192, Dv=128, bf16; the same tensors every layer):
- `256 new`: run_prefill_new_tokens over 1 x 256 new tokens (causal);
- `2048 new`: the same over 1 x 2048;
- `256 + ctx 2048`: new tokens 1 x 256 with LSE, then one context chunk (q 256 against kv 2048,
  non-causal, LSE), folded by merge_attn_states, as vLLM's CPU backend does.

Paths: `in process` (ragged_attention + merge here), `tcp` (a safetensors body), `regions over
HTTP` (the regions JSON in a POST /prefill), `regions call` (the same on the region socket, no
HTTP). One `zen-mla serve --workers 1` on a free loopback port; paired medians (the paths
interleaved rep by rep). `--service-cpus` puts the service on some CPUs and this process (the
orchestrator, and in process its kernels) on the others; without it all share every CPU.
Prints a Markdown table; writes bench/out/step.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/e2e.py: no spinning here

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
from _server import start_server
from kernel import cpu_line

import zen_mla
from tests.batches import cu_seq_lens
from zen_mla.attention.merge import merge_attn_states
from zen_mla.vllm import RemoteSettings, backend_class

LAYERS = 61
SCALE = c.DQK**-0.5
STEPS = {"256 new": (256, 0), "2048 new": (2048, 0), "256 + ctx 2048": (256, 2048)}
PATHS = ("tcp", "regions over HTTP", "regions call")


class _Meta:
    def __init__(self, query_start_loc: torch.Tensor) -> None:
        self.query_start_loc = query_start_loc


class _Chunk:
    def __init__(self, query_start_loc: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
        self.query_start_loc, self.cu_seq_lens = query_start_loc, cu_seq_lens


def rand(n: int, d: int) -> torch.Tensor:
    return torch.randn(n, c.H, d).bfloat16()


def in_process(new: int, ctx: int) -> Callable[[], object]:
    q, k, v = rand(new, c.DQK), rand(new, c.DQK), rand(new, c.DV)
    qc = cu_seq_lens([new], torch.int32)
    ck, cv, kc = rand(ctx, c.DQK), rand(ctx, c.DV), cu_seq_lens([ctx], torch.int32)

    def layer() -> object:
        if not ctx:
            return zen_mla.ragged_attention(q, k, v, qc, scale=SCALE)
        out, lse = zen_mla.ragged_attention(q, k, v, qc, return_lse=True, scale=SCALE)
        c_out, c_lse = zen_mla.ragged_attention(
            q, ck, cv, qc, kc, causal=False, return_lse=True, scale=SCALE
        )
        merged, merged_lse = torch.empty_like(out), torch.empty_like(lse)
        merge_attn_states(merged, c_out, c_lse, out, lse, merged_lse)
        return merged

    return lambda: [layer() for _ in range(LAYERS)]


def through(backend: Any, path: str, new: int, ctx: int) -> Callable[[], object]:
    q, k, v = rand(new, c.DQK), rand(new, c.DQK), rand(new, c.DV)
    qc = cu_seq_lens([new], torch.int32)
    ck, cv, kc = rand(ctx, c.DQK), rand(ctx, c.DV), cu_seq_lens([ctx], torch.int32)
    client = backend.client

    def layer() -> object:
        backend.prepare_metadata(_Meta(qc))
        if not ctx:
            return backend.run_prefill_new_tokens(q, k, v, False)
        out, lse = backend.run_prefill_new_tokens(q, k, v, True)
        c_out, c_lse = backend.run_prefill_context_chunk(_Chunk(qc, kc), q, ck, cv)
        merged, merged_lse = torch.empty_like(out), torch.empty_like(lse)
        merge_attn_states(merged, c_out, c_lse, out, lse, merged_lse)
        return merged

    def step() -> object:
        # The path, chosen for this benchmark only: the client takes regions and their call
        # path whenever the service offers them; here the choice is undone per path.
        client._shared_memory = False if path == "tcp" else None
        regions = client.regions(0) if path != "tcp" else None
        if regions is not None:
            regions.connection.hello["calls"] = path == "regions call"
        return [layer() for _ in range(LAYERS)]

    return step


def plot(ratios: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(PATHS)
    for i, p in enumerate(PATHS):
        xs = [j + i * width for j in range(len(ratios))]
        ax.bar(xs, [ratios[s][p] for s in ratios], width, label=p)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.15, color="grey", linestyle="--", linewidth=0.8, label="target 1.15x")
    ax.set_xticks([j + width * (len(PATHS) - 1) / 2 for j in range(len(ratios))], list(ratios))
    ax.set_ylabel("step time / in process")
    ax.set_title(f"{LAYERS} sequential prefill calls through zen_mla.vllm")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    c.service_cpus_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    service_cpus = c.split_cpus(args.service_cpus)
    proc, url = start_server("httptools", cpus=service_cpus)
    try:
        backend = backend_class()(
            c.H, SCALE, 512, 128, 64, c.DV, None, settings=RemoteSettings(urls=(url,))
        )
        rows, ratios = [], {}
        for name, (new, ctx) in STEPS.items():
            fns = {"in process": in_process(new, ctx)}
            fns |= {p: through(backend, p, new, ctx) for p in PATHS}
            medians = c.paired_medians(fns, args.reps)
            base = medians["in process"]
            ratios[name] = {p: medians[p] / base for p in PATHS}
            for p, s in medians.items():
                extra = (s - base) / LAYERS * 1e3
                rows.append(
                    [
                        name,
                        p,
                        f"{s * 1e3:.1f}",
                        f"{s / base:.2f}x",
                        "-" if s is base else f"{extra:.3f}",
                    ]
                )
        stats = zen_mla.vllm.stats.snapshot()
        assert stats.local == 0, f"calls fell back to local compute: {stats}"
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"CPU: {cpu_line(zen_mla.host_kernels())}; 1 worker; paired medians of {args.reps}\n")
    header = ["step (61 layers)", "path", "step ms", "vs in process", "ms a call over"]
    print(c.table(header, rows))
    plot(ratios, c.OUT_DIR / "step.png")


if __name__ == "__main__":
    main()
