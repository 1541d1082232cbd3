"""Latent-cache benchmark: MLA attention computed from the latent (`latent_attention`, its expand
and absorb forms and auto) against what vLLM does today, expanding the whole context's keys and
values with one fp32 matmul and handing them to `zen_mla.ragged_attention`.

    .venv/bin/python bench/latent.py [--reps 5] [--context 16384] [--new 64,256,2048]
    .venv/bin/python bench/latent.py --crossover [--lse] [--reps 5] [--context 16384] [--new 16,...]

One sequence per call: `--context` cached tokens then M new ones (causal, keys Tk = context + M),
DeepSeek-V3's dims (16 heads, kv_lora_rank 512, rope 64, Dqk 192, Dv 128), bf16 inputs. Prints
Markdown tables: the bytes a call carries either way (the weight is registered once, not sent
per call), paired medians of each method (interleaved rep by rep) with the FLOP the cost model
gives it, and each method's peak extra memory: the growth of VmHWM over one call in a fresh
process, the high-water mark reset first through /proc/self/clear_refs (the inputs do not count,
the output does), glibc's mmap threshold held at 128 KiB so that each block larger is fresh
pages. Writes bench/out/latent.png.

`--crossover` calibrates "auto" on this host instead: paired medians of the two forms forced and
of auto over a sweep of M (default 16 to 4096), auto's time over the better form's, and the
crossover measured (the least M of the sweep from which expanding is faster at every larger M)
beside the one auto takes (latent.py's rule at this context).
"""

from __future__ import annotations

import os

# Nothing else computes on these cores between the calls: wait passively. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import functools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
from kernel import cpu_line

import zen_mla
from zen_mla.attention import latent
from zen_mla.attention.batch import visible_pairs
from zen_mla.attention.latent import Form, Precision, bf16_unavailable, latent_attention

H, RANK, ROPE, NOPE, DV = 16, 512, 64, 128, 128
DQK = NOPE + ROPE
BASELINE = "expand all + ragged_attention"
#: auto with its LSE (bf16 products take the LSE's rounding move off: more work for expand)
AUTO_LSE = "auto, return_lse"
#: the same with precision="bf16": the LSE as bf16's rounding leaves it (the baseline's)
AUTO_LSE_BF16 = "auto, return_lse, bf16"
METHODS = ("expand", "absorb", "auto", AUTO_LSE, AUTO_LSE_BF16, BASELINE)
#: the M of `--crossover`'s sweep unless --new names others
SWEEP = (16, 32, 64, 96, 128, 160, 192, 224, 256, 384, 512, 1024, 2048, 4096)

#: glibc serves every block from 128 KiB up by its own mapping and unmaps it when freed (its
#: threshold otherwise rises to the largest block freed, up to 32 MiB, and a call's blocks then
#: reuse pages the warm-up left resident, unseen by VmHWM)
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


def auto_crossover(context: int, return_lse: bool = False) -> int:
    """The least M from which auto expands a sequence of `context` cached tokens and M new here
    (latent.py's rule, with the products this host takes for bf16 inputs)."""
    bf16 = bf16_unavailable() is None
    return next(
        m for m in range(1, 1 << 20) if not latent.absorbs(m, context + m, True, bf16, return_lse)
    )


def make_inputs(context: int, new: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One sequence's bf16 q `[M, H, Dqk]`, kv_c `[Tk, R]`, k_pe `[Tk, P]`, w_kv_b
    `[H (Dn + Dv), R]` (k_nope and v of about unit scale) and its offsets."""
    tk = context + new
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    return {
        "q": randn(new, H, DQK),
        "kv_c": randn(tk, RANK),
        "k_pe": randn(tk, ROPE),
        "w_kv_b": randn(H * (NOPE + DV), RANK, scale=RANK**-0.5),
        "q_cu_seq_lens": torch.tensor([0, new], dtype=torch.int32),
        "kv_cu_seq_lens": torch.tensor([0, tk], dtype=torch.int32),
    }


def expand_all(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """vLLM's path: the whole context's k_nope and v from one fp32 matmul, k_pe beside every
    head's k_nope, the bf16 keys and values to the ragged kernel."""
    kv_c, k_pe = x["kv_c"], x["k_pe"]
    tk = kv_c.shape[0]
    kv = torch.mm(kv_c.float(), x["w_kv_b"].float().t()).view(tk, H, NOPE + DV)
    k = torch.empty(tk, H, DQK, dtype=kv_c.dtype)
    k[..., :NOPE] = kv[..., :NOPE]
    k[..., NOPE:] = k_pe[:, None]
    v = kv[..., NOPE:].to(kv_c.dtype)
    del kv
    return zen_mla.ragged_attention(
        x["q"], k, v, x["q_cu_seq_lens"], x["kv_cu_seq_lens"], causal=True
    )


def method(name: str, x: dict[str, torch.Tensor]) -> Callable[[], object]:
    if name == BASELINE:
        return lambda: expand_all(x)
    if name == AUTO_LSE:
        return lambda: _latent(x, "auto", return_lse=True)
    if name == AUTO_LSE_BF16:
        return lambda: _latent(x, "auto", return_lse=True, precision="bf16")
    form = cast(Form, name)
    return lambda: _latent(x, form)


def _latent(
    x: dict[str, torch.Tensor],
    form: Form,
    *,
    return_lse: bool = False,
    precision: Precision = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    args = (x["q"], x["kv_c"], x["k_pe"], x["w_kv_b"], x["q_cu_seq_lens"], x["kv_cu_seq_lens"])
    if return_lse:
        return latent_attention(*args, causal=True, form=form, return_lse=True, precision=precision)
    return latent_attention(*args, causal=True, form=form, precision=precision)


def model_flops(name: str, context: int, new: int) -> float:
    """The cost model's FLOP of a call (latent.py's docstring): expanding every key, then
    Dqk/Dv attention; or absorbing, (R + P)/R attention plus folding each query in and out."""
    tk = context + new
    pairs = visible_pairs(new, tk, causal=True)
    form = (
        name
        if name in ("expand", "absorb")
        else "absorb"
        if new < auto_crossover(context)
        else "expand"
    )
    if name == BASELINE or form == "expand":
        return H * (2.0 * tk * RANK * (NOPE + DV) + 2.0 * pairs * (DQK + DV))
    return H * (2.0 * pairs * (2 * RANK + ROPE) + 2.0 * new * RANK * (NOPE + DV))


def byte_rows(context: int, news: list[int]) -> list[list[str]]:
    """Per M: the bytes a call sends expanded (k and v) and latent (kv_c and k_pe), q in both."""
    rows = []
    for new in news:
        tk, q = context + new, new * H * DQK * 2
        expanded = tk * H * DQK * 2 + tk * H * DV * 2 + q
        lat = tk * (RANK + ROPE) * 2 + q
        rows.append(
            [
                str(new),
                str(tk),
                f"{expanded / 2**20:.1f}",
                f"{lat / 2**20:.1f}",
                f"{expanded / lat:.1f}x",
            ]
        )
    return rows


def agreement(x: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each form's largest difference from the baseline's out (both bf16)."""
    base = expand_all(x).float()
    return {
        form: float((cast(torch.Tensor, _latent(x, form)).float() - base).abs().max())
        for form in ("expand", "absorb")
    }


def peak_extra(name: str, context: int, new: int) -> int:
    """`name`'s peak extra memory over one call, in a fresh process (`--memory-of`)."""
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--memory-of",
            name,
            "--context",
            str(context),
            "--new",
            str(new),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **FIXED_MMAP_THRESHOLD},
    )
    return int(json.loads(done.stdout.strip().splitlines()[-1]))


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def measure_memory(name: str, context: int, new: int) -> None:
    """In this (fresh) process: warm `name` up on a small call (threads, BLAS, the kernel's
    probes), make the inputs, reset VmHWM to VmRSS, make one call, print the growth."""
    method(name, make_inputs(300, min(new, 64), seed=1))()
    x = make_inputs(context, new)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmHWM")
    method(name, x)()
    print(json.dumps(_status("VmHWM") - before))


def plot(results: dict[int, dict[str, float]], path: Path) -> bool:
    """The medians as bars per M, to `path`; False where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(METHODS)
    for i, name in enumerate(METHODS):
        ax.bar(
            [b + i * width for b in range(len(results))],
            [med[name] * 1e3 for med in results.values()],
            width,
            label=name,
        )
    ax.set_xticks([b + 0.4 - width / 2 for b in range(len(results))], [f"M={m}" for m in results])
    ax.set_yscale("log")
    ax.set_ylabel("median ms (log)")
    ax.set_title("MLA attention from the latent cache, H=16, bf16 inputs (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def crossover(context: int, news: list[int], reps: int, return_lse: bool) -> None:
    """`--crossover`: the two forms forced and auto, paired, over a sweep of M, with the LSE
    asked or not; the crossover measured and the module's."""
    rows, faster = [], {}
    for new in news:
        x = make_inputs(context, new)
        forms: tuple[Form, ...] = ("expand", "absorb", "auto")
        calls: dict[str, Callable[[], object]] = {
            form: functools.partial(_latent, x, form, return_lse=return_lse) for form in forms
        }
        med = c.paired_medians(calls, reps)
        best = min(med["expand"], med["absorb"])
        faster[new] = med["expand"] < med["absorb"]
        rows.append(
            [str(new)]
            + [f"{med[form] * 1e3:.1f}" for form in forms]
            + [f"{med['absorb'] / med['expand']:.2f}", f"{med['auto'] / best:.2f}"]
        )
        print(f"M={new} done", file=sys.stderr, flush=True)
        del x
    print(
        f"\nPaired medians of {reps} reps, {context} cached tokens + M new, H={H}, bf16, "
        f"{torch.get_num_threads()} threads, the LSE {'asked' if return_lse else 'not asked'}\n"
    )
    header = ["M", "expand ms", "absorb ms", "auto ms", "absorb / expand", "auto / better"]
    print(c.table(header, rows))
    # the least M from which expanding wins at every M of the sweep
    measured = next(
        (m for m in news if all(faster[n] for n in news if n >= m)), max(news, default=0) + 1
    )
    print(
        f"\ncrossover measured here: M = {measured}; auto's: {auto_crossover(context, return_lse)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--context", type=int, default=16384, help="cached tokens before M")
    parser.add_argument("--new", help="the M of each row, comma separated (default 64,256,2048)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--crossover",
        action="store_true",
        help="calibrate auto: the forms over a sweep of M (--new, default 16 to 4096)",
    )
    parser.add_argument("--lse", action="store_true", help="--crossover with the LSE asked")
    parser.add_argument("--memory-of", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    default = ",".join(map(str, SWEEP)) if args.crossover else "64,256,2048"
    news = [int(m) for m in (args.new or default).split(",")]
    if args.memory_of:
        measure_memory(args.memory_of, args.context, news[0])
        return
    status = zen_mla.host_kernels()
    print(f"CPU: {cpu_line(status)}")
    why = bf16_unavailable()
    print(
        f"torch {torch.__version__}; the baseline's ragged kernel (auto): "
        f"{status['auto']['out']['kernel']}; latent_attention's products: "
        f"{'fp32 (' + why + ')' if why else 'bf16'}; auto absorbs below M = "
        f"{auto_crossover(args.context, args.lse)} at this context"
        f"{' with the LSE' if args.lse else ''}"
    )
    if args.crossover:
        crossover(args.context, news, args.reps, args.lse)
        return
    print(f"\nOne sequence: {args.context} cached tokens + M new, causal, H={H}, bf16\n")
    print(
        c.table(["M", "Tk", "expanded MiB", "latent MiB", "ratio"], byte_rows(args.context, news))
    )
    rows, results = [], {}
    for new in news:
        x = make_inputs(args.context, new)
        diff = agreement(x)
        print(
            f"\nM={new}: out differs from the baseline's by at most "
            + ", ".join(f"{d:.3g} ({form})" for form, d in diff.items())
        )
        med = c.paired_medians({name: method(name, x) for name in METHODS}, args.reps)
        results[new] = med
        for name, t in med.items():
            flops = model_flops(name, args.context, new)
            rows.append(
                [
                    str(new),
                    name,
                    f"{t * 1e3:.0f}",
                    f"{med[BASELINE] / t:.2f}x",
                    f"{flops / 1e9:.0f}",
                    f"{flops / t / 1e9:.0f}",
                ]
            )
        del x
    print(
        f"\nPaired medians of {args.reps} reps (interleaved), {torch.get_num_threads()} threads\n"
    )
    header = ["M", "method", "median ms", "vs baseline", "model GFLOP", "GFLOP/s"]
    print(c.table(header, rows))
    c.OUT_DIR.mkdir(exist_ok=True)
    path = c.OUT_DIR / "latent.png"
    drawn = plot(results, path)
    print(f"\nplot: {path}" if drawn else "\nno plot: matplotlib is not installed here")
    if args.skip_memory:
        return
    mem_rows = [
        [str(new), name, f"{peak_extra(name, args.context, new) / 2**20:.0f}"]
        for new in news
        for name in METHODS
    ]
    print("\nPeak extra memory of one call (VmHWM growth, fresh process each)\n")
    print(c.table(["M", "method", "peak extra MiB"], mem_rows))


if __name__ == "__main__":
    main()
