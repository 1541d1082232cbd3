"""What hostile requests cost a real `zen-mla serve` (one worker), and what they are charged.

- small body, large kernel: 100,000 and 400,000 heads of Dqk 2, one token, `kernel=native`
  (torch where the native kernel cannot run): the body's bytes, the charge the service puts on
  it (or its 422), and how far the worker's peak memory rose over the call;
- unread answers: `--answers` connections each ask for a 32 MiB answer and read nothing: the
  server's and the worker's shared memory (RssShmem) and `/health`'s held bytes before, at their
  most while the answers wait, and after the service has cut them.

Prints Markdown tables (the CPU named) and writes bench/out/charges.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from _common import OUT_DIR, table
from _server import start_server

from zen_mla import wire
from zen_mla.attention.batch import validate
from zen_mla.attention.driver import workspace_bytes
from zen_mla.attention.kernels import KERNELS
from zen_mla.attention.kernels.native import native_unavailable

MIB = 1 << 20


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def body_of(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    header, chunks = wire.encode(tensors, meta)
    return header + b"".join(bytes(c) for c in chunks)


def many_heads(heads: int) -> dict[str, torch.Tensor]:
    return {
        "q": torch.randn(1, heads, 2).bfloat16(),
        "k": torch.randn(1, heads, 2).bfloat16(),
        "v": torch.randn(1, heads, 1).bfloat16(),
        "q_cu_seq_lens": torch.tensor([0, 1], dtype=torch.int32),
    }


def charge(tensors: dict[str, torch.Tensor], kernel: str, threads: int) -> int:
    """The kernel's memory as the engine charges it (`PrefillRequest.cost`)."""
    t = tensors
    batch = validate(t["q"], t["k"], t["v"], t["q_cu_seq_lens"], None, causal=True, scale=None)
    return workspace_bytes(batch, KERNELS[kernel], return_lse=False, threads=threads)


def small_bodies(url: str, worker: int, threads: int, kernel: str) -> list[list[str]]:
    rows = []
    with httpx.Client(timeout=120) as c:  # what a worker makes once for its life, first
        c.post(
            url + "/prefill",
            content=body_of(many_heads(1), {"kernel": kernel}),
            headers={"Content-Type": "application/octet-stream"},
        )
    for heads in (100_000, 400_000):
        tensors = many_heads(heads)
        body = body_of(tensors, {"kernel": kernel})
        Path(f"/proc/{worker}/clear_refs").write_text("5")
        before = status_kib(worker, "VmRSS")
        with httpx.Client(timeout=120) as c:
            r = c.post(
                url + "/prefill",
                content=body,
                headers={"Content-Type": "application/octet-stream"},
            )
        grown = status_kib(worker, "VmHWM") - before
        said = r.json()["detail"] if r.status_code != 200 else ""
        rows.append(
            [
                f"{heads:,} heads, {kernel}",
                f"{len(body) / MIB:.1f}",
                f"{charge(tensors, kernel, threads) / MIB:.0f}",
                str(r.status_code),
                said[:90] if said else "-",
                f"{grown / MIB:.0f}",
            ]
        )
    return rows


def unread_answers(url: str, server: int, worker: int, n: int) -> tuple[list[list[str]], dict]:
    tokens, heads = 65536, 2
    tensors = {
        "q": torch.randn(tokens, heads, 128).bfloat16(),
        "k": torch.randn(1, heads, 128).bfloat16(),
        "v": torch.randn(1, heads, 128).bfloat16(),
        "q_cu_seq_lens": torch.tensor([0, tokens], dtype=torch.int32),
        "kv_cu_seq_lens": torch.tensor([0, 1], dtype=torch.int32),
    }
    body = body_of(tensors, {"causal": "false"})
    host, port = url.removeprefix("http://").split(":")

    def sample() -> dict[str, int]:
        held = httpx.get(url + "/health", timeout=30).json().get("held_bytes", {})
        return {
            "server_shmem": status_kib(server, "RssShmem"),
            "worker_shmem": status_kib(worker, "RssShmem"),
            "held_answer": held.get("answer", -1),
            "held_all": sum(held.values()) if held else -1,
        }

    before = sample()
    socks = []
    head = (
        b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=60)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(head + body)
        socks.append(s)
    most = dict(before)
    t0 = time.monotonic()
    cut_at = None
    while time.monotonic() - t0 < 60:
        now = sample()
        most = {k: max(most[k], v) for k, v in now.items()}
        if now["held_answer"] == 0 and most["held_answer"] > 0:
            cut_at = time.monotonic() - t0
            break
        time.sleep(0.25)
    after = sample()
    for s in socks:
        s.close()
    rows = [
        [what, *(f"{d[k] / MIB:.0f}" for k in ("server_shmem", "worker_shmem", "held_answer"))]
        for what, d in (("before", before), ("at most, unread", most), ("after the cut", after))
    ]
    return rows, {"cut_after_s": cut_at, "before": before, "most": most, "after": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--answers", type=int, default=8, help="connections not reading")
    args = parser.parse_args()
    kernel = "native" if not native_unavailable() else "torch"
    proc, url = start_server(
        "httptools", settings={"workers": "1", "max_inflight_bytes": str(2 << 30)}
    )
    try:
        health = httpx.get(url + "/health", timeout=30).json()
        ((worker, threads),) = [(w["pid"], w["threads"]) for w in health["workers"]]
        print(f"CPU: {cpu_name()}; one worker; --max-inflight-bytes 2 GiB\n")
        small = small_bodies(url, worker, threads, kernel)
        header = ["request", "body MiB", "kernel charged MiB", "status", "refusal"]
        print(table([*header, "worker's peak rise MiB"], small))
        rows, detail = unread_answers(url, proc.pid, worker, args.answers)
        print(f"\n{args.answers} connections, 32 MiB answers each, never read")
        print(
            table(["", "server RssShmem MiB", "worker RssShmem MiB", "held for answers MiB"], rows)
        )
        cut = detail["cut_after_s"]
        print(f"cut {cut:.1f} s after they were sent" if cut else "not cut within 60 s")
    finally:
        proc.terminate()
        proc.wait(30)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "charges.json").write_text(json.dumps({"small": small, "answers": detail}, indent=1))


if __name__ == "__main__":
    main()
