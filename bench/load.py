"""Load: N concurrent clients send the reference batches to a server with a small queue.

    .venv/bin/python bench/load.py [--clients 16] [--seconds 30] [--max-queue 4]
        [--workers 1,2,4] [--service-cpus half] [--kernel torch]

`--workers` starts one server per count in turn and `--clients` may list counts too (a row for
each pair: throughput of concurrent callers, and one caller's latency with `--clients 1,16`),
which is how `--workers auto`'s choice on a many-core host is measured.

Every answer must be a correct 200 (checked against in-process ragged_attention) or a 429 with
Retry-After (the client then waits that long). Prints latency percentiles, tokens/s and the
peak memory of the server's whole process tree; bounded in time and count, loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
from _server import start_server
from kernel import cpu_line

import zen_mla
from zen_mla import wire


def tree_rss(pid: int) -> int:
    """RSS of `pid` and its children (the workers), in bytes."""
    total = 0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


async def client(
    url: str,
    jobs: list[tuple[str, bytes, torch.Tensor, int]],
    stop: float,
    stats: dict[str, list[float]],
    counts: dict[str, int],
    offset: int,
) -> None:
    headers = {"Content-Type": "application/octet-stream"}
    async with httpx.AsyncClient(timeout=120) as http:
        i = offset
        while time.monotonic() < stop:
            name, body, want, tokens = jobs[i % len(jobs)]
            i += 1
            t0 = time.perf_counter()
            r = await http.post(url + "/prefill", content=body, headers=headers)
            dt = time.perf_counter() - t0
            if r.status_code == 200:
                got, _ = wire.decode(
                    torch.frombuffer(bytearray(r.content), dtype=torch.uint8), wire.RESPONSE_TENSORS
                )
                ok = torch.equal(got["out"], want)
                if not ok:
                    diff = (got["out"].float() - want.float()).abs().max().item()
                    print(f"WRONG {name}: max abs diff {diff}", file=sys.stderr)
                counts["200 correct" if ok else "200 WRONG"] += 1
                stats["latency"].append(dt)
                counts["tokens"] += tokens
            elif r.status_code == 429 and r.headers.get("retry-after", "").isdigit():
                counts["429 with Retry-After"] += 1
                await asyncio.sleep(min(float(r.headers["retry-after"]), 2.0))
            else:
                counts[f"{r.status_code} (unexpected)"] += 1


def measure(
    jobs: list[tuple[str, bytes, torch.Tensor, int]],
    workers: str | None,
    clients: int,
    seconds: float,
    cpus: tuple[int, ...] | None,
) -> tuple[dict[str, int], list[str]]:
    """One server (`workers` of them, its default where None) under `clients` clients for
    `seconds`: the answers counted, and the row of latency, throughput and memory."""
    if workers is not None:
        os.environ["ZEN_MLA_WORKERS"] = workers
    proc, url = start_server("httptools", cpus=cpus)
    base = tree_rss(proc.pid)
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stats: dict[str, list[float]] = {"latency": []}
    counts: defaultdict[str, int] = defaultdict(int)
    t0 = time.monotonic()
    stop = t0 + seconds

    async def run() -> None:
        await asyncio.gather(*(client(url, jobs, stop, stats, counts, i) for i in range(clients)))

    try:
        asyncio.run(run())
    finally:
        elapsed = time.monotonic() - t0
        done.set()
        sampler.join()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    lat = sorted(stats["latency"])
    p = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] * 1e3 if lat else float("nan")  # noqa: E731
    row = [
        workers or "default",
        str(clients),
        f"{p(0.5):.0f}",
        f"{p(0.99):.0f}",
        f"{statistics.mean(lat) * 1e3:.0f}" if lat else "-",
        f"{counts['tokens'] / elapsed:.0f}",
        f"{base >> 20}",
        f"{peak[0] >> 20}",
    ]
    return dict(counts), row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", default="16", help="a count, or a comma list of counts")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--max-queue", type=int, default=4)
    parser.add_argument(
        "--workers", help="comma list of worker counts, one server each (default: its own)"
    )
    parser.add_argument("--kernel", default="torch", help="the kernel every request names")
    c.service_cpus_option(parser)
    args = parser.parse_args()
    cpus = c.split_cpus(args.service_cpus)
    os.environ["ZEN_MLA_MAX_QUEUE"] = str(args.max_queue)
    jobs = []
    for name, spec in c.REFERENCE_BATCHES.items():
        x = c.make_inputs(spec)
        want = zen_mla.ragged_attention(*x.values(), causal=spec.causal, kernel=args.kernel)
        meta = {"causal": str(spec.causal).lower(), "kernel": args.kernel}
        header, chunks = wire.encode(x, meta)
        jobs.append((name, header + b"".join(bytes(ch) for ch in chunks), want, sum(spec.q_lens)))
    counts: defaultdict[str, int] = defaultdict(int)
    rows = []
    for workers in args.workers.split(",") if args.workers else [None]:
        for clients in (int(n) for n in args.clients.split(",")):
            got, row = measure(jobs, workers, clients, args.seconds, cpus)
            for k, v in got.items():
                counts[k] += v
            rows.append(row)
            done = f"workers {row[0]}, clients {row[1]}: p50 {row[2]} ms, {row[5]} tokens/s"
            print(done, flush=True)
    print(
        f"CPU: {cpu_line(zen_mla.host_kernels())}; service CPUs: {args.service_cpus or 'all'}; "
        f"{args.seconds:.0f} s a row, max_queue {args.max_queue}, kernel {args.kernel}, "
        f"batches {', '.join(c.REFERENCE_BATCHES)} in turn\n"
    )
    print(
        c.table(
            ["answer", "count"], [[k, str(v)] for k, v in sorted(counts.items()) if k != "tokens"]
        )
    )
    print()
    header = ["workers", "clients", "p50 ms", "p99 ms", "mean ms", "q tokens/s"]
    print(c.table([*header, "RSS before MiB", "RSS peak MiB"], rows))
    bad = sum(v for k, v in counts.items() if "WRONG" in k or "unexpected" in k)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
