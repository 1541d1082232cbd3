"""The caller's copies: a layer's tensors copied into the client's region and its result copied
out, on the calling thread (`zen_mla.copying`) or through `Tensor.copy_` (torch's thread team).

    .venv/bin/python bench/copies.py [--reps 20]

vLLM-shaped calls (`run_prefill_new_tokens` through `zen_mla.vllm`'s backend on the region
socket; v a split view of a wider tensor, as vLLM's is) of 1, 64, 256 and 1024 new tokens
(H=16, Dqk=192, Dv=128, bf16, causal), each way, against `ragged_attention` in process;
paired medians, the three interleaved in blocks of 10 calls. The calling process runs twice,
as a child of its own each time (OpenMP reads its wait policy once): with
`OMP_WAIT_POLICY=PASSIVE`, as every benchmark here, and with OpenMP's default (threads spin a
while after each parallel region), as an orchestrator that sets nothing. One `zen-mla serve
--workers 1` on a free loopback port. Prints a Markdown table; writes bench/out/copies.png.
"""

from __future__ import annotations

import os
import sys

if "--default-wait" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/e2e.py

import argparse
import json
import statistics
import subprocess
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
from zen_mla import copying
from zen_mla.vllm import RemoteSettings, backend_class

TOKENS = (1, 64, 256, 1024)
WAYS = ("in process", "copies on this thread", "copies through copy_")
POLICIES = {"PASSIVE": [], "default": ["--default-wait"]}


class _Meta:
    def __init__(self, query_start_loc: torch.Tensor) -> None:
        self.query_start_loc = query_start_loc


def _ways(backend: Any, n: int, scale: float) -> dict[str, Callable[[], object]]:
    """The three ways of one call of `n` new tokens."""
    q, k = (torch.randn(n, c.H, c.DQK).bfloat16() for _ in range(2))
    v = torch.randn(n, c.H, 2 * c.DV).bfloat16()[..., c.DV :]  # vLLM's split view
    qc = cu_seq_lens([n], torch.int32)
    small = copying.SMALL_COPY_BYTES

    def call(bound: int) -> None:
        backend.prepare_metadata(_Meta(qc))
        copying.SMALL_COPY_BYTES = bound
        try:
            backend.run_prefill_new_tokens(q, k, v, False)
        finally:
            copying.SMALL_COPY_BYTES = small

    return {
        WAYS[0]: lambda: zen_mla.ragged_attention(q, k, v, qc, scale=scale),
        WAYS[1]: lambda: call(small),
        WAYS[2]: lambda: call(0),
    }


def measure(url: str, reps: int) -> dict[str, dict[str, float]]:
    """{tokens: {way: median ms}} in this process: blocks of 10 calls each way, the order of the
    ways turned by one every block (what runs after the in-process kernel pays its wake-ups)."""
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    scale = c.DQK**-0.5
    backend = backend_class()(
        c.H, scale, 512, 128, 64, c.DV, None, settings=RemoteSettings(urls=(url,))
    )
    medians: dict[str, dict[str, float]] = {}
    for n in TOKENS:
        fns = list(_ways(backend, n, scale).items())
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        for _, fn in fns:
            fn()
        for rep in range(reps):
            turned = fns[rep % len(fns) :] + fns[: rep % len(fns)]
            for way, fn in turned:
                times[way] += [c.timed(fn) for _ in range(10)]
        medians[str(n)] = {w: statistics.median(ts) * 1e3 for w, ts in times.items()}
    return medians


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot)")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), sharey=True)
    for ax, (policy, by_tokens) in zip(axes, results.items(), strict=True):
        for way in WAYS[1:]:
            ratios = [by_tokens[str(n)][way] / by_tokens[str(n)][WAYS[0]] for n in TOKENS]
            ax.plot([str(n) for n in TOKENS], ratios, marker="o", label=way)
        ax.set_title(f"caller's wait policy: {policy}")
        ax.set_xlabel("new tokens per call")
        ax.axhline(1.0, color="grey", lw=0.5)
    axes[0].set_ylabel("call / in process")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--url", help=argparse.SUPPRESS)  # a child's: measure against it
    parser.add_argument("--default-wait", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.url:
        print(json.dumps(measure(args.url, args.reps)))
        return
    proc, url = start_server("httptools")
    try:
        results = {}
        for policy, flags in POLICIES.items():
            env = dict(os.environ)
            if flags:
                env.pop("OMP_WAIT_POLICY", None)
            child = subprocess.run(
                [sys.executable, __file__, "--url", url, "--reps", str(args.reps), *flags],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results[policy] = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"CPU: {cpu_line(zen_mla.host_kernels())}; 1 worker; paired medians, ms\n")
    rows = []
    for policy, by_tokens in results.items():
        for n in TOKENS:
            m = by_tokens[str(n)]
            base = m[WAYS[0]]
            rows.append(
                [policy, str(n), f"{base:.3f}"]
                + [f"{m[w]:.3f} ({m[w] / base:.2f}x)" for w in WAYS[1:]]
                + [f"{m[WAYS[2]] - m[WAYS[1]]:.3f}"]
            )
    header = ["caller's wait", "tokens", *WAYS, "saved ms"]
    print(c.table(header, rows))
    plot(results, c.OUT_DIR / "copies.png")


if __name__ == "__main__":
    main()
