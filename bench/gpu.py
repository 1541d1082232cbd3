"""The service as a GPU node's orchestrator calls it: CUDA tensors in, CUDA tensors out.

    .venv/bin/python bench/gpu.py [--reps 7] [--service-cpus half] [--batches long,chunk]

For each of the contract's reference batches (H=16, Dqk=192, Dv=128, bf16), first correctness,
then time:

1. every path's `out` (and LSE, where asked) against an fp32 reference computed on the GPU (on
   the CPU where there is none): no path may be further from it than in-process
   `ragged_attention` is, by more than `SLACK` (the service runs the same kernel);
2. paired medians of: the GPU's own SDPA (one call per sequence, bf16); the CPU in process
   (`ragged_attention` on this process's CPUs); the service called with CUDA tensors (results
   back on the device), the same with `out=` on the device, the service called with CPU
   tensors; and the bare pinned copies of the same bytes (q, k, v to the host, out and LSE
   back), the floor of any offload from the device.

Ratios are to the CPU in process, against the targets for a GPU node (service from CUDA: long and
mixed <= 1.03, short <= 1.25, chunk <= 1.05). Where torch sees no CUDA device the GPU's columns read
"-" and the CPU's are measured all the same. Runtime dependencies only (any torch 2.x, with or
without zentorch; no tritonclient). Prints a Markdown table; writes bench/out/gpu.json and
bench/out/gpu.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spinning between calls

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
from _server import start_server
from kernel import cpu_line

import zen_mla
from zen_mla.client import PrefillClient

SCALE = c.DQK**-0.5
#: how much further from the fp32 reference than in process a path may be (absolute, on top of
#: in process's own error): a few bf16 roundings of values near 1
SLACK = 1e-2
TARGETS = {"long": 1.03, "mixed": 1.03, "short": 1.25, "chunk": 1.05}
PATHS = ("GPU SDPA", "CPU in process", "from CUDA", "from CUDA, out=", "from CPU", "pinned copies")
GPU_PATHS = {"GPU SDPA", "from CUDA", "from CUDA, out=", "pinned copies"}
#: the most fp32 score bytes the reference holds at once (heads are taken in groups to fit)
REFERENCE_SCORES = 256 << 20

Tensors = dict[str, torch.Tensor]


def reference(x: Tensors, causal: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """out `[Tq, H, Dv]` and lse `[H, Tq]` in fp32, on `device`: one sequence and a group of
    heads at a time, scores dense, the causal mask bottom-right (query i sees keys j <= i +
    Sk - Sq)."""
    q, k, v = (x[n].to(device, torch.float32) for n in ("q", "k", "v"))
    qc, kc = x["q_cu_seq_lens"].tolist(), x["kv_cu_seq_lens"].tolist()
    out = torch.zeros(q.shape[0], c.H, c.DV, device=device)
    lse = torch.full((c.H, q.shape[0]), float("-inf"), device=device)
    for r in range(len(qc) - 1):
        qa, qb, ka, kb = qc[r], qc[r + 1], kc[r], kc[r + 1]
        sq, sk = qb - qa, kb - ka
        group = max(1, REFERENCE_SCORES // max(1, sq * sk * 4))
        for h in range(0, c.H, group):
            hs = slice(h, h + group)
            scores = torch.einsum("ihd,jhd->hij", q[qa:qb, hs], k[ka:kb, hs]) * SCALE
            if causal:
                i = torch.arange(sq, device=device).unsqueeze(1)
                j = torch.arange(sk, device=device).unsqueeze(0)
                scores = scores.masked_fill(j > i + (sk - sq), float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - row_lse.unsqueeze(-1))
            out[qa:qb, hs] = torch.einsum("hij,jhd->ihd", probs, v[ka:kb, hs])
            lse[hs, qa:qb] = row_lse
    return out, lse


def errors(got: object, ref: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float | None]:
    """Largest absolute error of out, and of the LSE where there is one."""
    out, lse = got if isinstance(got, tuple) else (got, None)
    assert isinstance(out, torch.Tensor)
    e_out = (out.to(ref[0].device, torch.float32) - ref[0]).abs().max().item()
    if lse is None:
        return e_out, None
    return e_out, (lse.to(ref[1].device) - ref[1]).abs().max().item()


def gpu_sdpa(x: Tensors, causal: bool) -> Callable[[], object]:
    """The GPU's own attention, one SDPA call per sequence (as a varlen kernel's reference)."""
    qc, kc = x["q_cu_seq_lens"].tolist(), x["kv_cu_seq_lens"].tolist()

    def heads_first(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return t[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, S, D]

    seqs = [
        (
            heads_first(x["q"], qc[r], qc[r + 1]),
            heads_first(x["k"], kc[r], kc[r + 1]),
            heads_first(x["v"], kc[r], kc[r + 1]),
        )
        for r in range(len(qc) - 1)
    ]

    def run() -> object:
        outs = [F.scaled_dot_product_attention(*s, is_causal=causal, scale=SCALE) for s in seqs]
        torch.cuda.synchronize()
        return outs

    return run


def pinned_copies(x: Tensors, return_lse: bool) -> Callable[[], object]:
    """q, k and v copied to pinned host memory, out (and the LSE) back: the bytes any offload
    from the device moves, at the link's own speed."""
    up = {n: torch.empty(x[n].shape, dtype=x[n].dtype, pin_memory=True) for n in ("q", "k", "v")}
    tq = x["q"].shape[0]
    back = [torch.empty(tq, c.H, c.DV, dtype=torch.bfloat16, device=x["q"].device)]
    if return_lse:
        back.append(torch.empty(c.H, tq, dtype=torch.float32, device=x["q"].device))
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in back]

    def run() -> object:
        for n, t in up.items():
            t.copy_(x[n])
        for dst, src in zip(back, host, strict=True):
            dst.copy_(src)
        torch.cuda.synchronize()
        return back

    return run


def synced(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn`, timed to the end of the device's work it queued."""

    def run() -> object:
        got = fn()
        torch.cuda.synchronize()
        return got

    return run


def measure(
    name: str, spec: c.RefBatch, client: PrefillClient, reps: int, cuda: bool
) -> dict[str, Any]:
    cpu = c.make_inputs(spec)
    kw: dict[str, Any] = {"causal": spec.causal, "return_lse": spec.return_lse, "scale": SCALE}
    args = [cpu[n] for n in ("q", "k", "v", "q_cu_seq_lens", "kv_cu_seq_lens")]
    fns: dict[str, Callable[[], object]] = {
        "CPU in process": lambda: zen_mla.ragged_attention(*args, **kw),
        "from CPU": lambda: client.prefill(*args, **kw),
    }
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        dev = {n: t.to(device) for n, t in cpu.items()}
        dargs = [dev[n] for n in ("q", "k", "v", "q_cu_seq_lens", "kv_cu_seq_lens")]
        out = torch.empty(sum(spec.q_lens), c.H, c.DV, dtype=torch.bfloat16, device=device)
        fns |= {
            "GPU SDPA": gpu_sdpa(dev, spec.causal),
            "from CUDA": synced(lambda: client.prefill(*dargs, **kw)),
            "from CUDA, out=": synced(lambda: client.prefill(*dargs, **kw, out=out)),
            "pinned copies": pinned_copies(dev, spec.return_lse),
        }
    ref = reference(cpu, spec.causal, device)
    errs = {p: errors(fns[p](), ref) for p in fns if p not in ("GPU SDPA", "pinned copies")}
    base_out, base_lse = errs["CPU in process"]
    for p, (e_out, e_lse) in errs.items():
        assert e_out <= base_out + SLACK, f"{name} {p}: out error {e_out:.3g} > {base_out:.3g}"
        if e_lse is not None:
            assert base_lse is not None and e_lse <= base_lse + SLACK, f"{name} {p}: lse {e_lse}"
    medians = c.paired_medians(fns, reps)
    return {"seconds": medians, "errors": errs}


def row(name: str, found: dict[str, Any]) -> list[str]:
    s = found["seconds"]
    base = s["CPU in process"]

    def cell(p: str, ratio: bool) -> str:
        if p not in s:
            return "-"
        return f"{s[p] * 1e3:.2f}" + (f" ({s[p] / base:.2f})" if ratio else "")

    cuda = s.get("from CUDA")
    target = TARGETS.get(name)
    verdict = "-" if cuda is None or target is None else ("yes" if cuda / base <= target else "no")
    err = max(e for e, _ in found["errors"].values())
    return [
        name,
        cell("GPU SDPA", False),
        cell("CPU in process", False),
        cell("from CUDA", True),
        cell("from CUDA, out=", True),
        cell("from CPU", True),
        cell("pinned copies", False),
        f"<= {target}: {verdict}" if target else "-",
        f"{err:.2e}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--batches", default=",".join(c.REFERENCE_BATCHES))
    c.service_cpus_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    service_cpus = c.split_cpus(args.service_cpus)
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else None
    proc, url = start_server("httptools", cpus=service_cpus)
    results: dict[str, Any] = {}
    try:
        with PrefillClient(url, timeout=600) as client:
            for name in args.batches.split(","):
                results[name] = measure(name, c.REFERENCE_BATCHES[name], client, args.reps, cuda)
    finally:
        proc.terminate()
        proc.wait(30)
    host = cpu_line(zen_mla.host_kernels())
    where = f"GPU: {gpu}" if gpu else "no CUDA device here: the GPU's columns are not measured"
    kernel = zen_mla.host_kernels()["auto"]["out"]["kernel"]
    head = [
        f"CPU: {host}; service CPUs: {args.service_cpus or 'all'}; {where}; "
        f"kernel: {kernel}; torch {torch.__version__}; paired medians of {args.reps}",
        "",
    ]
    header = [
        "batch",
        "GPU SDPA ms",
        "CPU in process ms",
        "service from CUDA ms (ratio)",
        "from CUDA, out= (ratio)",
        "from CPU tensors (ratio)",
        "pinned D2H+H2D ms",
        "target (from CUDA)",
        "max out error vs fp32",
    ]
    text = "\n".join([*head, c.table(header, [row(n, f) for n, f in results.items()])])
    print(text)
    c.OUT_DIR.mkdir(exist_ok=True)
    (c.OUT_DIR / "gpu.md").write_text(text + "\n")
    record = {"cpu": host, "gpu": gpu, "service_cpus": args.service_cpus, "kernel": kernel}
    record |= {"torch": torch.__version__, "reps": args.reps, "batches": results}
    (c.OUT_DIR / "gpu.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
