"""The call floor: what one prefill call costs beyond its kernel, part by part, for 1, 256 and
2048 tokens (H=16, Dqk=192, Dv=128, bf16, causal), medians from one run.

    .venv/bin/python bench/floor.py [--reps 200] [--service-cpus half]

Parts, each measured on its own, in this process unless it says otherwise:
- kernel: `ragged_attention` in process (what an orchestrator would pay computing itself);
- prepare: `PrefillEngine.prepare` (validation, caps, kernel choice);
- engine: prepare + run + result on a started engine with one worker, the inputs already in
  shared memory: kernel + the pool hop (task to a worker process and back), from a plain
  thread (the task goes through the worker's dispatcher thread) and from an event loop, as the
  service calls it (`run(loop=)`: straight to the idle worker, the answer read in the loop);
- http floor: `GET /health/live` through httpx on loopback (HTTP and routing, no body);
- tcp: `PrefillClient(shared_memory=False)`, the tensors in a safetensors body;
- regions: `PrefillClient(shared_memory=True)`, the tensors made with `empty()` (no copy), the
  regions JSON over HTTP (POST /prefill) and as a call on the region socket (no HTTP), which
  the client takes whenever the service offers it;
- copies: the caller's CPU tensors into a region (q, k, v) and the answer out of one (out), as
  the client makes them (`zen_mla.copying.copy_into`), each on its own; and the regions call
  from the caller's CPU tensors, which makes both (the call an orchestrator makes when its
  tensors are not in regions of their own);
- service CPU a call: the CPU time the service's main process (event loop, dispatcher) and its
  workers spent per regions call (no HTTP), summed over their threads: with `--service-cpus`
  both share the service's CPUs, so a call pays the two in turn.
Starts one `zen-mla serve --workers 1` on a free loopback port and stops it. `--service-cpus`
puts the service (and the engine rows' worker) on some CPUs and this process on the others, as
an orchestrator and the service sit on a GPU node; without it all share every CPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/e2e.py: no spinning here

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
from _server import cpu_seconds, server_timing, start_server
from kernel import cpu_line

import zen_mla
from zen_mla import wire
from zen_mla.client import PrefillClient
from zen_mla.copying import copy_into
from zen_mla.engine import EngineConfig, PrefillEngine
from zen_mla.pool import PoolConfig
from zen_mla.wire import PrefillOptions

TOKENS = (1, 256, 2048)
BIG = 2048  # timed max(5, reps // 20) times: a 2048-token kernel is 20-130 ms
OCTET = "application/octet-stream"


def median_ms(fn, reps: int, tokens: int = 1) -> float:
    if tokens >= BIG:
        reps = max(5, reps // 20)
    fn()  # warm
    times = [c.timed(fn) for _ in range(reps)]
    return statistics.median(times) * 1e3


def tensors(tokens: int, make=torch.randn) -> dict[str, torch.Tensor]:
    q = make((tokens, c.H, c.DQK), dtype=torch.bfloat16)
    k = make((tokens, c.H, c.DQK), dtype=torch.bfloat16)
    v = make((tokens, c.H, c.DV), dtype=torch.bfloat16)
    return {"q": q, "k": k, "v": v, "q_cu_seq_lens": torch.tensor([0, tokens], dtype=torch.int32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=200)
    c.service_cpus_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    service_cpus = c.split_cpus(args.service_cpus)
    rows: dict[str, dict[int, float]] = {}

    def put(part: str, tokens: int, ms: float) -> None:
        rows.setdefault(part, {})[tokens] = ms

    caller = os.sched_getaffinity(0)
    if service_cpus is not None:  # the engine's worker finds the service's CPUs, not ours
        os.sched_setaffinity(0, service_cpus)
    engine = PrefillEngine(EngineConfig(PoolConfig(workers=1)))
    os.sched_setaffinity(0, caller)
    with engine:
        for n in TOKENS:
            t = tensors(n)
            put(
                "kernel (in process)",
                n,
                median_ms(lambda t=t: zen_mla.ragged_attention(**t), args.reps, n),
            )
            buf = engine.buffer(sum(x.nbytes for x in t.values()) + 4096)
            at, placed = 0, {}
            for name, x in t.items():
                placed[name] = buf.tensor(at, tuple(x.shape), x.dtype).copy_(x)
                at += (x.nbytes + 63) // 64 * 64
            put("prepare", n, median_ms(lambda p=placed: engine.prepare(p), args.reps, n))

            def through_engine(p=placed, b=buf) -> None:
                engine.run(engine.prepare(p, PrefillOptions()), inputs=b).result(60).release()

            put("engine (prepare + pool hop + kernel)", n, median_ms(through_engine, args.reps, n))

            async def from_loop(p=placed, b=buf) -> None:
                loop = asyncio.get_running_loop()
                job = engine.run(engine.prepare(p, PrefillOptions()), inputs=b, loop=loop)
                (await job.wait(60)).release()

            async def timed_from_loop(tokens: int = n) -> float:
                await from_loop()  # warm
                times = []
                for _ in range(args.reps if tokens < BIG else max(5, args.reps // 20)):
                    t0 = time.perf_counter()
                    await from_loop()
                    times.append(time.perf_counter() - t0)
                return statistics.median(times) * 1e3

            put("engine from an event loop (direct)", n, asyncio.run(timed_from_loop()))

    proc, url = start_server("httptools", cpus=service_cpus)
    try:
        with httpx.Client(base_url=url) as h:
            put(
                "http floor (GET /health/live)",
                1,
                median_ms(lambda: h.get("/health/live"), args.reps),
            )
            for n in TOKENS:
                t = tensors(n)
                header, chunks = wire.encode(t, {})
                body = header + b"".join(bytes(x) for x in chunks)
                phases: dict[str, list[float]] = {}

                def raw(body=body, phases=phases) -> None:
                    r = h.post("/prefill", content=body, headers={"Content-Type": OCTET})
                    for name, ms in server_timing(r).items():
                        phases.setdefault(name, []).append(ms * 1e3)

                put("tcp, prebuilt body, answer not decoded", n, median_ms(raw, args.reps, n))
                for name, values in phases.items():
                    put(f"  server: {name}", n, statistics.median(values))
        for n in TOKENS:
            with PrefillClient(url, shared_memory=False) as client:
                t = tensors(n)
                put(
                    "tcp (PrefillClient)",
                    n,
                    median_ms(lambda t=t: client.prefill(**t), args.reps, n),
                )
            with PrefillClient(url, shared_memory=True) as client:
                t = tensors(n, make=lambda shape, dtype: client.empty(shape, dtype).normal_())
                regions = client.regions(0)
                assert regions is not None and regions.connection.calls
                for part, calls in (("regions over HTTP", False), ("regions call (no HTTP)", True)):
                    # the client takes the call path whenever offered: undone here to compare
                    regions.connection.hello["calls"] = calls
                    put(
                        f"{part} (PrefillClient, empty())",
                        n,
                        median_ms(lambda t=t: client.prefill(**t), args.reps, n),
                    )
                regions.connection.hello["calls"] = True
                # where the service's CPU goes in one such call: with --service-cpus the server
                # and the worker share the service's CPUs, and the call waits for both in turn
                calls = args.reps if n < BIG else max(5, args.reps // 20)
                before = cpu_seconds(proc.pid)
                for _ in range(calls):
                    client.prefill(**t)
                after = cpu_seconds(proc.pid)
                for who in ("server", "workers"):
                    put(
                        f"  service CPU a call: {who} (mean)",
                        n,
                        (after[who] - before[who]) / calls * 1e3,
                    )
                mine = tensors(n)  # the caller's own CPU tensors: copied in and out
                put(
                    "regions call (PrefillClient, CPU tensors)",
                    n,
                    median_ms(lambda m=mine: client.prefill(**m), args.reps, n),
                )
                for name in ("q", "k", "v"):
                    put(
                        f"  copy in: {name} into a region",
                        n,
                        median_ms(lambda a=t[name], b=mine[name]: copy_into(a, b), args.reps, n),
                    )
                out = zen_mla.ragged_attention(**mine)
                region_out = client.empty(out.shape, out.dtype)
                caller_out = torch.empty_like(out)
                put(
                    "  copy out: out from a region",
                    n,
                    median_ms(lambda a=caller_out, b=region_out: copy_into(a, b), args.reps, n),
                )
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"CPU: {cpu_line(zen_mla.host_kernels())}")
    header = ["part", *[f"{n} token{'s' if n > 1 else ''} ms" for n in TOKENS]]
    body = [[part, *[f"{v[n]:.3f}" if n in v else "-" for n in TOKENS]] for part, v in rows.items()]
    print(c.table(header, body))


if __name__ == "__main__":
    main()
