"""Pool benchmark: the worker pool against one process running ragged_attention on every core.

    .venv/bin/python bench/pool.py [--reps 7]

Prints Markdown tables (docs/benchmarks.md) and writes bench/out/pool.png. Paired runs in one
run of this script; quote the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c

import zen_mla
from tests.batches import cu_seq_lens
from zen_mla.attention import select_kernel, validate
from zen_mla.pool import PoolConfig, WorkerPool
from zen_mla.pool._schedule import schedule


def plan_on_paper(workers: int = 12) -> str:
    """How the cost model splits `mixed` and `long` over the 12 CCXs of an EPYC 9654."""
    rows = []
    for name in ("long", "mixed"):
        spec = c.REFERENCE_BATCHES[name]
        plan = schedule(
            tuple(cu_seq_lens(spec.q_lens).tolist()),
            tuple(cu_seq_lens(spec.kv_lens).tolist()),
            c.H,
            spec.causal,
            workers,
        )
        loads = [sum(p.cost for p in mine) for mine in plan]
        ideal = sum(loads) / workers
        q_cu = cu_seq_lens(spec.q_lens).tolist()
        for w, mine in enumerate(plan):
            desc = []
            for p in mine:
                if p.r1 > p.r0 + 1:
                    desc.append(f"reqs {p.r0}-{p.r1 - 1} whole")
                    continue
                a, b = p.q_lo - q_cu[p.r0], p.q_hi - q_cu[p.r0]
                part = "" if (a, b) == (0, spec.q_lens[p.r0]) else f" rows {a}-{b - 1}"
                desc.append(f"req {p.r0} heads {p.h0}-{p.h1 - 1}{part}")
            rows.append([name, str(w), ", ".join(desc), f"{loads[w] / ideal:.2f}"])
    return c.table(["batch", "CCX", "pieces", "load / ideal"], rows)


def on_pool(pool: WorkerPool, x: dict[str, torch.Tensor], **kw: bool) -> Callable[[], object]:
    """A batch run through `pool` as the service runs it: inputs already in the pool's shared
    memory (the HTTP layer reads request bodies into it), so nothing is copied per call."""
    buf, offset, shared = pool.buffer(sum(t.nbytes for t in x.values())), 0, []
    for t in (x["q"], x["k"], x["v"]):
        shared.append(buf.tensor(offset, t.shape, t.dtype).copy_(t))
        offset += t.nbytes
    q_cu, kv_cu = x["q_cu_seq_lens"], x["kv_cu_seq_lens"]
    causal, return_lse = kw.get("causal", True), kw.get("return_lse", False)

    def call() -> None:
        # per call, as the engine's prepare() and run() do per request
        batch = validate(*shared, q_cu, kv_cu, causal=causal, scale=None)
        kernel = select_kernel("auto", batch.q.dtype, return_lse=return_lse).name
        pool.submit_batch(batch, kernel, return_lse=return_lse, inputs=buf).result().release()

    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print(
        f"CPUs: {cpus}, in-process threads: {torch.get_num_threads()}, "
        f"auto kernel: {zen_mla.host_kernels()['auto']['out']['kernel']}\n"
    )
    configs = {f"pool {cpus}x1": PoolConfig(workers=cpus), f"pool 1x{cpus}": PoolConfig(workers=1)}
    pools = {name: WorkerPool(cfg).start() for name, cfg in configs.items()}
    rows, ratios = [], {}
    try:
        for name, spec in c.REFERENCE_BATCHES.items():
            x = c.make_inputs(spec)
            a = (x["q"], x["k"], x["v"], x["q_cu_seq_lens"], x["kv_cu_seq_lens"])
            kw: dict[str, bool] = {"causal": spec.causal, "return_lse": spec.return_lse}

            fns = {"one process": lambda: zen_mla.ragged_attention(*a, **kw)}  # noqa: B023
            fns |= {n: on_pool(p, x, **kw) for n, p in pools.items()}
            med = c.paired_medians(fns, args.reps)
            for method, t in med.items():
                ratio = med["one process"] / t
                ratios.setdefault(method, {})[name] = ratio
                rows.append([name, method, f"{t * 1e3:.2f}", f"{ratio:.2f}x"])
        print(c.table(["batch", "method", "median ms", "speed vs one process"], rows))

        tiny = c.RefBatch([1], [1], causal=True, return_lse=False)
        x = c.make_inputs(tiny)
        a = (x["q"], x["k"], x["v"], x["q_cu_seq_lens"])
        tiny_on_pool = on_pool(pools[f"pool {cpus}x1"], x)
        inproc, pooled = [], []
        for _ in range(200):
            inproc.append(c.timed(lambda: zen_mla.ragged_attention(*a)))
            pooled.append(c.timed(tiny_on_pool))
        overhead = statistics.median(pooled) - statistics.median(inproc)
        print(
            f"\nDispatch overhead (1-token batch, median of 200): {overhead * 1e3:.3f} ms "
            f"(pool {statistics.median(pooled) * 1e3:.3f} ms, "
            f"in-process {statistics.median(inproc) * 1e3:.3f} ms)"
        )
    finally:
        for p in pools.values():
            p.close()
    print("\nOn paper: the cost model over the 12 CCXs of an EPYC 9654 (16 heads)\n")
    print(plan_on_paper())
    plot(ratios, c.OUT_DIR / "pool.png")


def plot(ratios: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c.OUT_DIR.mkdir(exist_ok=True)
    names = list(c.REFERENCE_BATCHES)
    fig, ax = plt.subplots(figsize=(8, 4))
    methods = [m for m in ratios if m != "one process"]
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ax.bar(
            [b + i * width for b in range(len(names))],
            [ratios[m][n] for n in names],
            width,
            label=m,
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([b + 0.4 - width / 2 for b in range(len(names))], names)
    ax.set_ylabel("speed vs one process (higher is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
