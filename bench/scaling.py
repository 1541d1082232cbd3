"""How the kernels scale with threads: the reference batches in process at 1, half and all of
this process's CPUs (or `--threads`), useful GFLOP/s and the speed-up from half to all.

    .venv/bin/python bench/scaling.py [--threads 1,8,16] [--kernels native,torch] [--reps 5]

A kernel that gives each thread a share of a call's work runs faster with more threads; one
whose work split leaves threads idle, or whose threads fight over memory, does not (`chunk`
on the `torch` kernel ran at 585 GFLOP/s on 8 cores of a 16-core Xeon and 492 on 16). The
target: `chunk` at 16 threads >= 1.5x its 8-thread speed. Paired medians per thread
count (the kernels interleaved); prints a Markdown table; writes bench/out/scaling.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
from kernel import cpu_line

import zen_mla
from zen_mla.attention.kernels import KERNELS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    cpus = len(os.sched_getaffinity(0))
    default = sorted({1, max(1, cpus // 2), cpus})
    parser.add_argument("--threads", default=",".join(map(str, default)))
    parser.add_argument("--kernels", help="comma list (default: auto's pick for bf16, and torch)")
    parser.add_argument("--batches", default=",".join(c.REFERENCE_BATCHES))
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    status = zen_mla.host_kernels()
    kernels = (
        args.kernels.split(",")
        if args.kernels
        else sorted({status["auto"]["out"]["kernel"], "torch"})
    )
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise SystemExit(f"--kernels: unknown {unknown}; expected among {sorted(KERNELS)}")
    threads = sorted({int(t) for t in args.threads.split(",")})
    most = threads[-1]
    half = max([t for t in threads if t <= most // 2], default=threads[0])
    seconds: dict[str, dict[str, dict[int, float]]] = {}
    for name in args.batches.split(","):
        spec = c.REFERENCE_BATCHES[name]
        x = c.make_inputs(spec)
        a = [x[n] for n in ("q", "k", "v", "q_cu_seq_lens", "kv_cu_seq_lens")]
        kw = {"causal": spec.causal, "return_lse": spec.return_lse}
        fns = {
            k: (lambda k=k, a=a, kw=kw: zen_mla.ragged_attention(*a, **kw, kernel=k))
            for k in kernels
        }
        for n in threads:
            torch.set_num_threads(n)
            for k, s in c.paired_medians(fns, args.reps).items():
                seconds.setdefault(name, {}).setdefault(k, {})[n] = s
    rows = []
    for name, by_kernel in seconds.items():
        flops = c.useful_flops(c.REFERENCE_BATCHES[name])
        for k, by_threads in by_kernel.items():
            gflops = [f"{flops / by_threads[n] / 1e9:.0f}" for n in threads]
            gain = by_threads[half] / by_threads[most]
            rows.append([name, k, *gflops, f"{gain:.2f}x"])
    torch.set_num_threads(cpus)
    print(f"CPU: {cpu_line(status)} of {cpus}; paired medians of {args.reps}\n")
    header = ["batch", "kernel", *[f"GFLOP/s, {n} thr" for n in threads], f"{most} / {half} thr"]
    print(c.table(header, rows))
    c.OUT_DIR.mkdir(exist_ok=True)
    record = {"cpu": cpu_line(status), "threads": threads, "seconds": seconds}
    (c.OUT_DIR / "scaling.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
