"""Kernel benchmark: zen_mla.ragged_attention against vLLM's CPU MLA prefill paths, side by side.

    .venv/bin/python bench/kernel.py [--reps 7] [--skip-memory]

Prints Markdown tables (paste into README.md) and writes bench/out/kernel.png.
Times are medians of interleaved runs in one process with the same threads; quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
import vllm_baseline

import zen_mla


def roofline_tflops(reps: int) -> float:
    a = torch.randn(4096, 4096).bfloat16()
    b = torch.randn(4096, 4096).bfloat16()
    a @ b
    t = min(c.timed(lambda: a @ b) for _ in range(reps))  # a roofline is the best case
    return 2 * 4096**3 / t / 1e12


def methods(spec: c.RefBatch, has_zen: bool, has_native: bool) -> dict[str, Callable[[], object]]:
    """Every method timed on one reference batch, vLLM's first."""
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
    return fns


def speed(reps: int, batches: list[str]) -> tuple[list[list[str]], dict[str, dict[str, float]]]:
    status = zen_mla.zentorch_status()
    has_zen, has_native = status["ops"]["zentorch_sdpa"], status["native"]["ok"]
    rows, results = [], {}
    for name in batches:
        spec = c.REFERENCE_BATCHES[name]
        med = c.paired_medians(methods(spec, has_zen, has_native), reps)
        results[name] = med
        flops = c.useful_flops(spec)
        for method, t in med.items():
            ref = med["vllm fp32 lse"] if "lse" in method else med.get("vllm zen loop")
            rows.append(
                [
                    name,
                    method,
                    f"{t * 1e3:.2f}",
                    f"{ref / t:.2f}x" if ref else "-",
                    f"{flops / t / 1e12:.3f}",
                ]
            )
    return rows, results


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
zen_mla.zentorch_status()
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


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

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


#: issue 33's targets for the native kernel: no-LSE against the seed's zentorch loop, LSE
#: against the LSE path before it (zentorch's LSE route), useful rate against the roofline
NATIVE_TARGETS = {
    "long": (1.25, None, 0.75),
    "mixed": (1.25, None, 0.75),
    "short": (1.0, None, None),
    "chunk": (1.25, 1.25, 0.6),
}


def native_target_rows(results: dict[str, dict[str, float]], roof: float) -> list[list[str]]:
    """Per batch: the native kernel against its targets, each figure with its target."""
    rows = []
    for name, med in results.items():
        if "ours native" not in med or "vllm zen loop" not in med:
            continue
        speedup, lse_speedup, rate = NATIVE_TARGETS[name]
        flops = c.useful_flops(c.REFERENCE_BATCHES[name])
        got = med["vllm zen loop"] / med["ours native"]
        row = [name, f"{got:.2f}x (>= {speedup}x)"]
        before = med.get("ours lse (zentorch)", med["ours lse (torch flash)"])
        got_lse = before / med["ours lse (native)"]
        row.append(f"{got_lse:.2f}x" + (f" (>= {lse_speedup}x)" if lse_speedup else ""))
        of_roof = flops / med["ours native"] / 1e12 / roof
        row.append(f"{of_roof:.2f}" + (f" (>= {rate})" if rate else ""))
        met = got >= speedup and (not lse_speedup or got_lse >= lse_speedup)
        row.append("yes" if met and (not rate or of_roof >= rate) else "no")
        rows.append(row)
    return rows


MEMORY_METHODS = {
    "native": "ours lse (native)",
    "zentorch": "ours lse (zentorch)",
    "torch": "ours lse (torch flash)",
    "reference": "ours lse reference",
    "vllm": "vllm fp32 lse",
}


def cpu_line(status: dict[str, object]) -> str:
    """The CPU the figures were measured on, with the flags that decide the kernels."""
    cpu = status["cpu"]
    assert isinstance(cpu, dict)
    return (
        f"{cpu['model']} ({cpu['vendor']}, family {cpu['family']}"
        f"{', Zen' if cpu['zen'] else ''}), AVX-512 BF16: {'yes' if cpu['avx512_bf16'] else 'no'}, "
        f"AMX: {'yes' if cpu['amx_bf16'] else 'no'}, threads: {torch.get_num_threads()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--batches", default=",".join(c.REFERENCE_BATCHES))
    args = parser.parse_args()
    c.OUT_DIR.mkdir(exist_ok=True)
    status = zen_mla.zentorch_status()
    print(f"CPU: {cpu_line(status)}")
    print(
        f"zentorch {status['version']}, op usable: {status['ops']['zentorch_sdpa']}, "
        f"LSE route usable: {status['ops']['zentorch_sdpa_lse']}; auto -> "
        f"{status['auto_kernel']}, auto with LSE -> {status['lse_kernel']}"
    )
    roof = roofline_tflops(args.reps)
    print(f"\nRoofline: 4096^3 bf16 matmul = {roof:.3f} TFLOP/s\n")
    rows, results = speed(args.reps, args.batches.split(","))
    for r in rows:
        r.append(f"{float(r[4]) / roof:.0%}")
    print(
        c.table(["batch", "method", "median ms", "vs vLLM", "useful TFLOP/s", "of roofline"], rows)
    )
    print("\nThe LSE path against the no-LSE path (both auto) and against vLLM's fp32 LSE path\n")
    print(
        c.table(
            ["batch", "no-LSE ms", "LSE ms", "LSE / no-LSE", "LSE vs vLLM fp32 lse"],
            lse_cost_rows(results),
        )
    )
    targets = native_target_rows(results, roof)
    if targets:
        print("\nThe native kernel against issue 33's targets (paired, same threads)\n")
        header = ["batch", "vs vLLM zen loop", "LSE vs zentorch LSE route", "of roofline", "met"]
        print(c.table(header, targets))
    plot(results, c.OUT_DIR / "kernel.png")
    print(f"\nplot: {c.OUT_DIR / 'kernel.png'}")
    if not args.skip_memory:
        mem_rows = []
        for method, label in MEMORY_METHODS.items():
            if method == "zentorch" and not status["ops"]["zentorch_sdpa_lse"]:
                continue
            if method == "native" and not status["native"]["ok"]:
                continue
            b = peak_extra_memory(method, 8192)
            mem_rows.append(["1 x 8192", label, f"{b / 2**30:.2f}"])
        print("\nPeak extra memory, LSE path, H=16, causal\n")
        print(c.table(["batch", "method", "peak extra GiB"], mem_rows))


if __name__ == "__main__":
    main()
