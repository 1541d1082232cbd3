"""Shared pieces of the benchmark scripts: the contract's reference batches (built as the tests
build theirs: tests/batches.py), timing, tables, the CPUs a benchmark and its service run on."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.batches import BatchSpec, make_batch

OUT_DIR = Path(__file__).parent / "out"
H, DQK, DV = 16, 192, 128


@dataclass(frozen=True)
class RefBatch:
    q_lens: list[int]
    kv_lens: list[int]
    causal: bool
    return_lse: bool


# The contract's reference batches (DeepSeek-V3/R1 MLA, 16 heads per TP rank, bf16).
REFERENCE_BATCHES = {
    "long": RefBatch([4096], [4096], causal=True, return_lse=False),
    "mixed": RefBatch(
        [2048, 1024, 512, 256, 128, 64], [2048, 1024, 512, 256, 128, 64], True, False
    ),
    "short": RefBatch([64] * 32, [64] * 32, causal=True, return_lse=False),
    "chunk": RefBatch([256] * 4, [2048] * 4, causal=False, return_lse=True),
}


def make_inputs(spec: RefBatch, seed: int = 0) -> dict[str, torch.Tensor]:
    """The batch's bf16 tensors of the contract's heads, by the names the service takes; both
    cumulative lengths int32."""
    q, k, v, q_cu, kv_cu = make_batch(
        BatchSpec(spec.q_lens, spec.kv_lens), (H, DQK, DV), torch.bfloat16, seed
    )
    assert kv_cu is not None
    return {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu, "kv_cu_seq_lens": kv_cu.int()}


def useful_flops(spec: RefBatch) -> float:
    """2 * H * (Dqk + Dv) per visible (query, key) pair: the work attention must do."""
    from zen_mla.attention.batch import visible_pairs

    pairs = sum(
        visible_pairs(sq, sk, spec.causal) for sq, sk in zip(spec.q_lens, spec.kv_lens, strict=True)
    )
    return 2.0 * H * (DQK + DV) * pairs


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired_medians(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each function, run interleaved (a, b, c, a, b, c, ...) after a warm-up,
    so a noisy neighbour hits every method alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        padded = (str(c).ljust(w) for c, w in zip(cells, widths, strict=True))
        return "| " + " | ".join(padded) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def service_cpus_option(parser: argparse.ArgumentParser) -> None:
    """`--service-cpus`, as every benchmark that starts a service takes it (`split_cpus`)."""
    parser.add_argument(
        "--service-cpus",
        help='the service on these CPUs ("1,3", or "half"), this process on the others',
    )


def split_cpus(service: str | None) -> tuple[int, ...] | None:
    """`--service-cpus`: the CPUs the service is to run on (a comma list, or "half": the upper
    half of this process's), this process then pinned to the others and its torch threads to
    their count, as an orchestrator and the service sit on a GPU node (each on cores of its
    own); None (both on every CPU) without it."""
    if service is None:
        return None
    mine = sorted(os.sched_getaffinity(0))
    if service == "half":
        chosen = tuple(mine[len(mine) // 2 :])
    else:
        chosen = tuple(int(x) for x in service.split(","))
    rest = [x for x in mine if x not in chosen]
    if not chosen or not rest or not set(chosen) <= set(mine):
        raise SystemExit(f"--service-cpus {service}: expected some of {mine}, not all")
    os.sched_setaffinity(0, rest)
    torch.set_num_threads(len(rest))
    return chosen
