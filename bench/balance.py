"""Balancing over a name that resolves to many replicas: three `zen-mla serve` (one worker
each) on 127.0.0.1, 127.0.0.2 and 127.0.0.3, one port, one name for all three in the client's
own /etc/hosts (a private mount namespace: `unshare -m`, root only), as a Kubernetes headless
Service stands for its ready pods (tests/client/replicas.py starts and drives them).

    .venv/bin/python bench/balance.py [--calls 300] [--concurrency 1,2,3,6] [--client sync]

Prints, at each concurrency (calls in flight at once), the calls each replica answered (its own
/metrics: `zen_mla_requests_total`), the largest spread from an even share (target: within
10%) and the calls' p50/p99; then, calls running, one replica killed (SIGKILL) and started
again: the calls failed, those past the client's deadline (target 0), the longest call, the
calls the restarted replica answered 503 while starting (target 0: none sent before its
`/health/ready` said 200) and how soon it got work once ready. Writes bench/out/balance.png.
The client and the replicas share this host's CPUs.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # processes that time things wait passively

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c

from tests.client.replicas import ADDRESSES, NAME, Driver, Replicas, hosts_text, namespace_problem
from tests.processes import wait_for

KILLED = 1  # the replica killed and started again: 127.0.0.2


def spread_rows(
    replicas: Replicas, client: Driver, calls: int, levels: list[int]
) -> tuple[list[list[str]], dict[int, list[int]]]:
    rows, per_level = [], {}
    for threads in levels:
        before = replicas.answered()
        summary = client.ask("run", calls=calls, threads=threads)
        got = [a - b for a, b in zip(replicas.answered(), before, strict=True)]
        even = calls / len(ADDRESSES)
        spread = max(abs(n - even) for n in got) / even
        failed = summary["calls"] - summary["ok"]
        per_level[threads] = got
        p50, p99 = f"{summary['p50'] * 1e3:.1f}", f"{summary['p99'] * 1e3:.1f}"
        rows.append([str(threads), *map(str, got), f"±{spread:.1%}", str(failed), p50, p99])
    return rows, per_level


def kill_run(
    replicas: Replicas, client: Driver, threads: int, timeout: float
) -> tuple[list[list[str]], dict[str, Any]]:
    """Calls running: the replica killed after 2 s, started again 2 s later, then 3 s more
    once it answers work."""
    t0 = client.ask("start", threads=threads)["t0"]
    time.sleep(2.0)
    replicas.kill(KILLED)
    killed = time.monotonic()
    time.sleep(2.0)
    replicas.launch(KILLED)
    restarted = time.monotonic()

    def ready() -> bool:
        try:
            return httpx.get(replicas.url(KILLED) + "/health/ready", timeout=5).is_success
        except httpx.HTTPError:
            return False

    wait_for(ready, 180, "the restarted replica never said ready", 0.02)
    ready_at = time.monotonic()
    wait_for(lambda: replicas.counts(KILLED).get(200, 0) > 0, 30, "no work once ready", 0.02)
    first_work = time.monotonic()
    time.sleep(3.0)
    summary = client.ask("stop")
    replicas.wait(KILLED)
    counts = replicas.counts(KILLED)
    failed = summary["calls"] - summary["ok"]
    errors = ", ".join(f"{k} {v}" for k, v in summary["errors"].items()) or "none"
    rows = [
        ["calls (in flight at once)", f"{summary['calls']} ({threads})"],
        ["calls failed", f"{failed} ({errors})"],
        [f"calls failed or past the deadline ({timeout:g} s)", str(summary["past_deadline"])],
        ["longest call", f"{summary['max'] * 1e3:.0f} ms"],
        ["p50 / p99 call", f"{summary['p50'] * 1e3:.1f} / {summary['p99'] * 1e3:.1f} ms"],
        ["restarted: starting for (its /health/ready 503)", f"{ready_at - restarted:.1f} s"],
        ["restarted: work sent before ready (its 503s)", str(counts.get(503, 0))],
        ["restarted: first work after ready", f"{(first_work - ready_at) * 1e3:.0f} ms"],
    ]
    if "local" in summary["stats"]:  # the vLLM link: a call it could not send is computed here
        stats = summary["stats"]
        local = f"{stats['local']} (since the client's process started)"
        rows.insert(2, ["computed in-process (the link's fallback)", local])
        rows.insert(3, ["link outages", str(stats["outages"])])
    marks = {"killed": killed, "restarted": restarted, "ready": ready_at}
    return rows, {"records": summary["records"], "marks": {k: v - t0 for k, v in marks.items()}}


def plot(per_level: dict[int, list[int]], calls: int, run: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), width_ratios=(1, 2))
    width = 0.8 / len(ADDRESSES)
    levels = list(per_level)
    for j, address in enumerate(ADDRESSES):
        xs = [x + (j - 1) * width for x in range(len(levels))]
        left.bar(xs, [per_level[t][j] for t in levels], width, label=address)
    even = calls / len(ADDRESSES)
    left.axhspan(0.9 * even, 1.1 * even, color="grey", alpha=0.2, label="even ±10%")
    left.set_xticks(range(len(levels)), [str(t) for t in levels])
    left.set_xlabel("calls in flight at once")
    left.set_ylabel(f"calls answered (of {calls})")
    left.set_ylim(0, 1.5 * even)
    left.legend(fontsize=8, ncols=2, loc="upper center")
    ok = [(t, d * 1e3) for t, d, o in run["records"] if o == "ok"]
    bad = [(t, d * 1e3) for t, d, o in run["records"] if o != "ok"]
    right.scatter(*zip(*ok, strict=True), s=4, label="answered")
    if bad:
        right.scatter(*zip(*bad, strict=True), s=12, color="tab:red", label="failed")
    for name, at in run["marks"].items():
        right.axvline(at, color="black", linestyle="--", linewidth=0.8)
        right.annotate(name, (at, right.get_ylim()[1]), rotation=90, va="top", fontsize=8)
    right.set_yscale("log")
    right.set_xlabel("seconds into the run")
    right.set_ylabel("call, ms")
    right.set_title(f"{ADDRESSES[KILLED]} killed and started again")
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = [line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line]
    return f"{model[0] if model else 'unknown CPU'}, {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300, help="calls at each concurrency")
    parser.add_argument("--concurrency", default="1,2,3,6", help="calls in flight at once")
    parser.add_argument("--kill-concurrency", type=int, default=2)
    parser.add_argument("--client", choices=("sync", "async", "link"), default="sync")
    parser.add_argument("--timeout", type=float, default=10.0, help="the client's deadline, s")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="zen-mla-balance-") as tmp:
        problem = namespace_problem(Path(tmp))
        if problem:
            raise SystemExit(f"bench/balance.py needs an /etc/hosts of the client's own: {problem}")
        replicas = Replicas(Path(tmp))
        try:
            replicas.start()
            hosts = Path(tmp) / "hosts"
            hosts.write_text(hosts_text(ADDRESSES))
            url = f"http://{NAME}:{replicas.port}"
            options = ("--client", args.client, "--timeout", str(args.timeout))
            client = Driver(hosts, url, *options)
            try:
                rows, per_level = spread_rows(replicas, client, args.calls, levels)
                kill_rows, run = kill_run(replicas, client, args.kill_concurrency, args.timeout)
            finally:
                client.close()
        finally:
            replicas.close()
    print(f"{args.client} client, {url} -> {', '.join(ADDRESSES)}; {cpu_name()}\n")
    print(f"{args.calls} calls at each concurrency, each replica's count from its /metrics:\n")
    head = ["in flight", *ADDRESSES, "spread vs even", "failed", "p50 ms", "p99 ms"]
    print(c.table(head, rows))
    print(f"\n{ADDRESSES[KILLED]} killed 2 s into a run, started again 2 s later:\n")
    print(c.table(["one replica killed and restarted", "measured"], kill_rows))
    plot(per_level, args.calls, run, c.OUT_DIR / "balance.png")


if __name__ == "__main__":
    main()
