"""End-to-end benchmark: the client's POST /prefill on loopback against in-process
ragged_attention, and the service's ingest/egress rates, for uvicorn's httptools and h11.

    .venv/bin/python bench/e2e.py [--reps 7]

Starts its own `zen-mla serve` processes on free loopback ports and stops them. Prints Markdown
tables (the README has them) and writes bench/out/e2e.png.
"""

from __future__ import annotations

import os

# The in-process runs interleaved with the service's leave this process's OpenMP threads
# spinning after each call (the OpenMP runtime's default wait); on 2 cores they take the CPU
# from the service's workers and from the next in-process call alike (measured, one token:
# in-process 2.35 -> 0.55 ms and through the service 7.4 -> 5.2 ms with passive waiting). An
# orchestrator computes nothing on these cores, so the benchmark waits passively. Set before
# torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c

import zen_mla
from zen_mla import wire
from zen_mla.client import PrefillClient

ROOT = Path(__file__).resolve().parent.parent


def start_server(http: str, uds: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = ["--uds", uds] if uds else ["--port", str(port)]
    env = dict(
        os.environ,
        ZEN_MLA_HTTP=http,
        ZEN_MLA_MAX_BODY_BYTES=str(1 << 30),
        ZEN_MLA_LOG_LEVEL="warning",
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from service.cli import main; main()",
            "serve",
            *where,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = "http://zen-mla" if uds else f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if uds is None or os.path.exists(uds):
            try:
                transport = httpx.HTTPTransport(uds=uds) if uds else None
                with httpx.Client(transport=transport, timeout=2) as client:
                    if client.get(url + "/health").json()["status"] == "ok":
                        return proc, url
            except (httpx.HTTPError, ValueError):
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server ({http}) did not start")


def server_timing(response: httpx.Response) -> dict[str, float]:
    out = {}
    for part in response.headers.get("server-timing", "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur) / 1e3
    return out


def transfer(url: str, mib: int, direction: str, reps: int) -> tuple[float, float]:
    """(ingest GB/s as the server read it, egress GB/s) for a body or response of `mib` MiB
    whose attention is trivial: 1 query against many keys (ingest), many queries against one
    key (egress)."""
    h, d = 16, 192
    tokens = (mib << 20) // (h * d * 2)
    if direction == "ingest":
        big = torch.zeros(tokens, h, d).bfloat16()
        tensors = {
            "q": big[:1],
            "k": big,
            "v": big[:, :, :128],
            "q_cu_seq_lens": torch.tensor([0, 1]),
            "kv_cu_seq_lens": torch.tensor([0, tokens]),
        }
    else:
        big = torch.zeros(tokens, h, d).bfloat16()
        one = torch.zeros(1, h, d).bfloat16()
        tensors = {
            "q": big,
            "k": one,
            "v": one,
            "q_cu_seq_lens": torch.tensor([0, tokens]),
            "kv_cu_seq_lens": torch.tensor([0, 1]),
        }
    header, chunks = wire.encode(tensors, {"causal": "false"})
    body = header + b"".join(bytes(ch) for ch in chunks)
    step = 256 << 10  # as PrefillClient sends: see SEND_PART in zen_mla/client.py
    parts = [memoryview(body)[i : i + step] for i in range(0, len(body), step)]
    headers = {"Content-Type": "application/octet-stream"}
    ingest, egress = [], []
    with httpx.Client(timeout=120) as client:
        for _ in range(reps):
            t0 = time.perf_counter()
            r = client.post(
                url + "/prefill",
                content=iter(parts),
                headers=headers | {"Content-Length": str(len(body))},
            )
            wall = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            st = server_timing(r)
            ingest.append(len(body) / st["ingest"] / 1e9)
            rest = wall - st["ingest"] - st["queue"] - st["compute"]
            egress.append(len(r.content) / max(rest, 1e-9) / 1e9)
    return statistics.median(ingest), statistics.median(egress)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    uds = f"/tmp/zen-mla-bench-{os.getpid()}.sock"
    servers = {http: start_server(http) for http in ("httptools", "h11")}
    servers["uds"] = start_server("httptools", uds)
    try:
        rows, ratios = [], {}
        with (
            PrefillClient(servers["httptools"][1], shared_memory=False) as tcp,
            PrefillClient(servers["uds"][1], uds=uds, shared_memory=False) as unix,
            PrefillClient(servers["httptools"][1], shared_memory=True) as shm,
        ):
            for name, spec in c.REFERENCE_BATCHES.items():
                x = c.make_inputs(spec)
                a = (x["q"], x["k"], x["v"], x["q_cu_seq_lens"], x["kv_cu_seq_lens"])
                # the same inputs built in the client's regions: sent without a copy
                z = tuple(shm.empty(t.shape, t.dtype).copy_(t) for t in a[:3]) + a[3:]
                kw = {"causal": spec.causal, "return_lse": spec.return_lse}
                med = c.paired_medians(
                    {
                        "in-process": lambda a=a, kw=kw: zen_mla.ragged_attention(*a, **kw),
                        "tcp": lambda a=a, kw=kw: tcp.prefill(*a, **kw),
                        "uds": lambda a=a, kw=kw: unix.prefill(*a, **kw),
                        "shm": lambda a=a, kw=kw: shm.prefill(*a, **kw),
                        "shm empty()": lambda z=z, kw=kw: shm.prefill(*z, **kw),
                    },
                    args.reps,
                )
                base = med["in-process"]
                for method in ("tcp", "uds", "shm", "shm empty()"):
                    ratios[f"{name}\n{method}"] = med[method] / base
                mib = sum(t.nbytes for t in x.values()) / 2**20
                rows.append(
                    [
                        name,
                        f"{mib:.0f}",
                        f"{base * 1e3:.2f}",
                        *(
                            f"{med[m] * 1e3:.2f} ({med[m] / base:.2f})"
                            for m in ("tcp", "uds", "shm", "shm empty()")
                        ),
                    ]
                )
            one = c.make_inputs(c.RefBatch([1], [1], causal=True, return_lse=False))
            a1 = (one["q"], one["k"], one["v"], one["q_cu_seq_lens"], one["kv_cu_seq_lens"])
            tiny = c.paired_medians(
                {
                    "in-process": lambda: zen_mla.ragged_attention(*a1),
                    "tcp": lambda: tcp.prefill(*a1),
                    "uds": lambda: unix.prefill(*a1),
                    "shm": lambda: shm.prefill(*a1),
                },
                max(25, args.reps),
            )
        print("End to end (httptools), paired medians: ms (ratio to in-process)\n")
        header = ["batch", "body MiB", "in-process ms", "tcp", "uds", "shm", "shm empty()"]
        print(c.table(header, rows))
        print("\nOne token (dispatch overhead), median ms\n")
        print(c.table(list(tiny), [[f"{t * 1e3:.2f}" for t in tiny.values()]]))

        io_rows = []
        for http, (_, u) in list(servers.items())[:2]:
            for mib in (64, 256):
                ingest, _ = transfer(u, mib, "ingest", max(3, args.reps // 2))
                _, egress = transfer(u, mib, "egress", max(3, args.reps // 2))
                io_rows.append([http, f"{mib} MiB", f"{ingest:.2f}", f"{egress:.2f}"])
        print("\nIngest (server reading the body into shared memory) and egress, GB/s\n")
        print(c.table(["http", "size", "ingest GB/s", "egress GB/s"], io_rows))
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    plot(ratios, io_rows)


def plot(ratios: dict[str, float], io_rows: list[list[str]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c.OUT_DIR.mkdir(exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 4.5))
    left.bar(list(ratios), list(ratios.values()), color="tab:blue")
    left.tick_params(axis="x", labelsize=6)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.axhline(1.1, color="tab:red", linestyle="--", linewidth=0.8, label="shm target 1.1")
    left.set_ylabel("e2e / in-process time (lower is better)")
    left.legend()
    labels = [f"{r[0]}\n{r[1]}" for r in io_rows]
    xs = range(len(io_rows))
    right.bar([x - 0.2 for x in xs], [float(r[2]) for r in io_rows], 0.4, label="ingest")
    right.bar([x + 0.2 for x in xs], [float(r[3]) for r in io_rows], 0.4, label="egress")
    right.set_xticks(list(xs), labels)
    right.set_ylabel("GB/s")
    right.legend()
    fig.tight_layout()
    path = c.OUT_DIR / "e2e.png"
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
