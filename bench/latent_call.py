"""A call over MLA's latent cache through a real `zen-mla serve`, against the expanded call vLLM
makes today: what each carries and how long each takes.

    .venv/bin/python bench/latent_call.py [--reps 5] [--context 16384] [--new 64,256,2048]
        [--heads 16]

One sequence a call: `--context` cached tokens then M new ones (causal), DeepSeek's dims
(kv_lora_rank 512, rope 64, Dqk 192, Dv 128), bf16, `PrefillClient` over TCP on loopback (no
same-host regions: the bytes cross the socket).

- latent: `prefill_latent` with the layer's `kv_b_proj` weight registered once
  (`register_weight`, sent with the first call only): the call carries q, kv_c and k_pe; its
  LSE within 1e-3 of fp64 (`precision="auto"`), and as bf16's rounding of the keys leaves it
  (`precision="bf16"`: what the expanded call's LSE is, its keys rounded by vLLM's matmul).
- expanded: what vLLM does before its prefill backend sees the context: `kv_b_proj` on every
  context token (one matmul, in this process, on the same cores: bf16 where the CPU has bf16
  arithmetic, else fp32 as vLLM's own fallback would be no faster), then `prefill` with q, k, v.

Prints Markdown tables (the CPU named): the bytes each call's safetensors body carries (the
weight excluded: registered once), and paired medians (interleaved rep by rep) of each call,
the expanded one split into its matmul and its call. Writes bench/out/latent_call.json, and
bench/out/latent_call.png where matplotlib is installed.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from _common import OUT_DIR, paired_medians, table
from _server import start_server

from zen_mla import wire
from zen_mla.attention.host import cpu_facts
from zen_mla.client import PrefillClient

RANK, ROPE, NOPE, DV = 512, 64, 128, 128


def body_bytes(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> int:
    """The bytes of the safetensors body that carries `tensors`."""
    header, chunks = wire.encode(tensors, meta)
    return len(header) + sum(c.nbytes for c in chunks)


def measure(
    client: PrefillClient, w: torch.Tensor, heads: int, context: int, m: int, reps: int
) -> dict[str, float]:
    """One sequence of `context` cached and `m` new tokens, both ways (`w` the registered
    weight "layer", in the dtype vLLM's matmul expands with)."""
    h, tk, dtype = heads, context + m, torch.bfloat16
    gen = torch.Generator().manual_seed(m)
    q = torch.randn(m, h, NOPE + ROPE, generator=gen).to(dtype)
    kv_c = torch.randn(tk, RANK, generator=gen).to(dtype)
    k_pe = torch.randn(tk, ROPE, generator=gen).to(dtype)
    q_cu = torch.tensor([0, m], dtype=torch.int32)
    kv_cu = torch.tensor([0, tk], dtype=torch.int32)
    expanded: dict[str, torch.Tensor] = {}

    def expand() -> None:
        kv = (kv_c.to(w.dtype) @ w.T).to(dtype).view(tk, h, NOPE + DV)
        k = torch.cat([kv[..., :NOPE], k_pe[:, None].expand(tk, h, ROPE)], dim=-1)
        expanded["k"], expanded["v"] = k, kv[..., NOPE:]

    def call_expanded() -> None:
        client.prefill(q, expanded["k"], expanded["v"], q_cu, kv_cu, return_lse=True)

    def call_latent() -> None:
        client.prefill_latent(q, kv_c, k_pe, "layer", q_cu, kv_cu, return_lse=True)

    def call_latent_bf16() -> None:
        client.prefill_latent(
            q, kv_c, k_pe, "layer", q_cu, kv_cu, return_lse=True, precision="bf16"
        )

    expand()
    calls: dict[str, Callable[[], object]] = {
        "latent": call_latent,
        "latent bf16": call_latent_bf16,
        "expand": expand,
        "expanded call": call_expanded,
    }
    times = paired_medians(calls, reps)
    meta = {"causal": "true", "return_lse": "true"}
    latent = {"q": q, "kv_c": kv_c, "k_pe": k_pe, "q_cu_seq_lens": q_cu, "kv_cu_seq_lens": kv_cu}
    full = {"q": q, "k": expanded["k"].contiguous(), "v": expanded["v"].contiguous()}
    full |= {"q_cu_seq_lens": q_cu, "kv_cu_seq_lens": kv_cu}
    return {
        "new": m,
        "latent_bytes": body_bytes(latent, meta | {"weight": "layer", "form": "auto"}),
        "expanded_bytes": body_bytes(full, meta),
        "latent_s": times["latent"],
        "latent_bf16_s": times["latent bf16"],
        "expand_s": times["expand"],
        "expanded_call_s": times["expanded call"],
        "ratio": times["latent"] / (times["expand"] + times["expanded call"]),
        "ratio_bf16": times["latent bf16"] / (times["expand"] + times["expanded call"]),
    }


def plot(results: list[dict[str, float]], path: Path) -> bool:
    """Each call's median by new tokens, the expanded one stacked (its matmul, then its call),
    to `path`; False where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    at = range(len(results))
    expand = [r["expand_s"] * 1e3 for r in results]
    ax.bar([x - 0.27 for x in at], expand, 0.27, label="vLLM's kv_b_proj")
    ax.bar(
        [x - 0.27 for x in at],
        [r["expanded_call_s"] * 1e3 for r in results],
        0.27,
        bottom=expand,
        label="then the expanded call",
    )
    ax.bar(at, [r["latent_s"] * 1e3 for r in results], 0.27, label="latent call")
    ax.bar(
        [x + 0.27 for x in at],
        [r["latent_bf16_s"] * 1e3 for r in results],
        0.27,
        label='latent call, precision="bf16"',
    )
    ax.set_xticks(list(at), [f"{r['new']:.0f} new" for r in results])
    ax.set_ylabel("median ms")
    ax.set_title("A call over a cached context, latent or expanded (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument(
        "--new", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 2048]
    )
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    h, c = args.heads, args.context
    cpu = cpu_facts()
    bf16_products = cpu.avx512_bf16 or cpu.amx_bf16
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(h * (NOPE + DV), RANK, generator=gen) / RANK**0.5).bfloat16()
    print(
        f"latent call through zen-mla serve on {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} CPUs), {h} heads, {c} cached tokens; kv_b_proj in "
        f"{'bf16' if bf16_products else 'fp32'}",
        file=sys.stderr,
    )
    proc, url = start_server("httptools")
    results = []
    try:
        with PrefillClient(url, shared_memory=False, timeout=600) as client:
            client.register_weight("layer", w)
            w_expand = w if bf16_products else w.float()
            for m in args.new:
                results.append(measure(client, w_expand, h, c, m, args.reps))
                print(f"  {results[-1]}", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait()
    rows = [
        [
            str(r["new"]),
            f"{r['expanded_bytes'] / 2**20:.1f}",
            f"{r['latent_bytes'] / 2**20:.1f}",
            f"{r['expanded_bytes'] / r['latent_bytes']:.1f}x",
            f"{r['expand_s'] * 1e3:.0f} + {r['expanded_call_s'] * 1e3:.0f}",
            f"{r['latent_s'] * 1e3:.0f}",
            f"{r['ratio']:.2f}",
            f"{r['latent_bf16_s'] * 1e3:.0f}",
            f"{r['ratio_bf16']:.2f}",
        ]
        for r in results
    ]
    print(
        f"\n{c} cached tokens, {h} heads, bf16, one sequence, over TCP (paired medians of "
        f"{args.reps})"
    )
    print(
        table(
            [
                "new tokens",
                "expanded call MiB",
                "latent call MiB",
                "fewer bytes",
                "expand + expanded call ms",
                "latent call ms",
                "latent / expanded",
                "latent bf16 ms",
                "latent bf16 / expanded",
            ],
            rows,
        )
    )
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "latent_call.json").write_text(json.dumps(results, indent=1))
    plot(results, OUT_DIR / "latent_call.png")


if __name__ == "__main__":
    main()
