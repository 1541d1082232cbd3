"""What the native kernel's calls leave resident, measured in a fresh process (run as
`python -m tests.attention.native_memory ...`, printing one JSON object): `shapes` sweeps many
distinct head counts and head dims and reports the growth of RssAnon; `peak` makes one call and
reports the peak growth of the resident set during it and `NativeKernel.workspace_bytes`.

Both set torch's threads to 2 first (each thread keeps its own oneDNN kernels) and warm up on a
shape of their own, so what is measured is the kernel's, not the first call's of the process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

import torch

from tests.reference import attention_fp64
from zen_mla.attention import RaggedBatch, validate
from zen_mla.attention.kernels.native import NativeKernel

THREADS = 2

#: (H, Dqk, Dv, q lens, kv lens, causal) of `peak`'s cases
PEAK_CASES = {
    # 3.8 MiB of q, k and v whose padding (32 keys of 64 + 64 columns for one key of 2 + 1)
    # made the kernel pack 844 MiB at once
    "hostile_heads": (400_000, 2, 1, [1], [1], True),
    "mla_long": (16, 192, 128, [4096], [4096], True),
    "mla_chunk": (16, 192, 128, [256] * 4, [2048] * 4, False),
    "many_short": (16, 192, 128, [64] * 32, [64] * 32, True),
    "wide_heads_tails": (4, 300, 260, [130, 7, 0], [700, 33, 5], True),
}

#: the bounds of `shapes`' sweep: head counts, head dims, query and key lengths
MAX_HEADS, MAX_DQK, MAX_LEN = 48, 320, 130


def status(key: str) -> int:
    """A /proc/self/status line's value, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)])


def make(
    heads: int, dqk: int, dv: int, q_lens: list[int], kv_lens: list[int], causal: bool
) -> RaggedBatch:
    gen = torch.Generator().manual_seed(heads + dqk + dv)
    tq, tk = sum(q_lens), sum(kv_lens)
    q = torch.randn(tq, heads, dqk, generator=gen).bfloat16()
    k = torch.randn(tk, heads, dqk, generator=gen).bfloat16()
    v = torch.randn(tk, heads, dv, generator=gen).bfloat16()
    return validate(q, k, v, cu(q_lens), cu(kv_lens), causal=causal, scale=None)


def run(batch: RaggedBatch, out: torch.Tensor, lse: torch.Tensor) -> None:
    NativeKernel.forward_ragged(batch, out, lse)


def warm_up() -> None:
    batch = make(2, 192, 128, [300], [300], True)
    run(batch, torch.empty(300, 2, 128, dtype=torch.bfloat16), torch.empty(2, 300))


def peak(case: str) -> dict[str, int]:
    """One call of `case` after a warm-up: VmHWM's rise over VmRSS (the peak reset by
    clear_refs) while it runs, with out and lse allocated before."""
    warm_up()
    heads, dqk, dv, q_lens, kv_lens, causal = PEAK_CASES[case]
    batch = make(heads, dqk, dv, q_lens, kv_lens, causal)
    tq = sum(q_lens)
    out = torch.zeros(tq, heads, dv, dtype=torch.bfloat16)
    lse = torch.zeros(heads, tq)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    run(batch, out, lse)
    return {
        "peak_growth": status("VmHWM") - before,
        "workspace_bytes": NativeKernel.workspace_bytes(
            batch, return_lse=True, threads=torch.get_num_threads()
        ),
        # the same without the threads' tiles, which the warm-up's call left them to keep
        "untiled_bytes": NativeKernel.workspace_bytes(batch, return_lse=True, threads=0),
        "input_bytes": sum(t.numel() * t.element_size() for t in (batch.q, batch.k, batch.v)),
    }


def shapes(count: int, checked: int) -> dict[str, object]:
    """RssAnon's growth over `count` calls of distinct (H, Dqk, Dv), q and k read in place from
    buffers allocated once (so that only the kernel allocates), after one call of the largest
    shape (the packing buffer the kernel keeps is then as large as the sweep makes it); then
    `checked` of the calls, made again, against fp64 (the largest error of out)."""
    rng = random.Random(0)
    cases: list[tuple[int, int, int, int, int]] = []
    seen: set[tuple[int, int, int]] = set()
    while len(cases) < count:
        heads, dqk = rng.randint(1, MAX_HEADS), rng.randint(1, MAX_DQK)
        dv = rng.randint(1, dqk)
        if (heads, dqk, dv) not in seen:
            seen.add((heads, dqk, dv))
            cases.append((heads, dqk, dv, rng.randint(1, MAX_LEN), rng.randint(1, MAX_LEN)))
    gen = torch.Generator().manual_seed(1)
    size = MAX_LEN * MAX_HEADS * MAX_DQK
    flat = {name: torch.randn(size, generator=gen).bfloat16() for name in "qkv"}
    out_flat = torch.empty(size, dtype=torch.bfloat16)
    lse_flat = torch.empty(MAX_HEADS * MAX_LEN)

    def call(heads: int, dqk: int, dv: int, sq: int, sk: int) -> tuple[RaggedBatch, torch.Tensor]:
        q = flat["q"][: sq * heads * dqk].view(sq, heads, dqk)  # q's row stride follows H
        k = flat["k"][: sk * heads * dqk].view(sk, heads, dqk)
        v = flat["v"][: sk * heads * dv].view(sk, heads, dv)
        batch = validate(q, k, v, cu([sq]), cu([sk]), causal=True, scale=None)
        out = out_flat[: sq * heads * dv].view(sq, heads, dv)
        run(batch, out, lse_flat[: heads * sq].view(heads, sq))
        return batch, out

    call(MAX_HEADS, MAX_DQK, MAX_DQK, MAX_LEN, MAX_LEN)
    before = status("RssAnon")
    for case in cases:
        call(*case)
    growth = status("RssAnon") - before
    worst = 0.0  # the checks run after the measure: the fp64 reference allocates
    for case in cases[:: count // checked]:
        batch, out = call(*case)
        want, _ = attention_fp64(
            batch.q, batch.k, batch.v, [0, case[3]], [0, case[4]], causal=True, scale=batch.scale
        )
        worst = max(worst, float((out.double() - want).abs().max()))
    return {"growth": growth, "shapes": count, "max_error": worst}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("peak").add_argument("case", choices=PEAK_CASES)
    sweep = sub.add_parser("shapes")
    sweep.add_argument("count", type=int)
    sweep.add_argument("checked", type=int)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    result = peak(args.case) if args.what == "peak" else shapes(args.count, args.checked)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
