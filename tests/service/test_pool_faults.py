"""The worker pool's faults seen through a real server: empty batches, no descriptors left, the
server killed under a busy worker."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import torch

import zen_mla
from tests.batches import DTYPES, EMPTY_SPECS, BatchSpec, make_batch
from tests.processes import eventually, open_fds
from tests.service.bodies import OCTET
from tests.service.servers import Server, busy_worker, serve
from zen_mla import wire
from zen_mla.client import PrefillClient

#: the server's kernel against the library's fp32 reference: a rounding step of the dtype
ATOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("spec", EMPTY_SPECS.values(), ids=EMPTY_SPECS.keys())
def test_empty_round_trip(server, spec, dtype, return_lse, causal):
    q, k, v, q_cu, kv_cu = make_batch(spec, (4, 192, 128), dtype)
    want = zen_mla.ragged_attention(
        q, k, v, q_cu, kv_cu, causal=causal, return_lse=return_lse, kernel="reference"
    )
    with PrefillClient(server.url) as client:
        got = client.prefill(q, k, v, q_cu, kv_cu, causal=causal, return_lse=return_lse)
    out, lse = got if return_lse else (got, None)
    want_out, want_lse = want if return_lse else (want, None)
    assert out.shape == want_out.shape and out.dtype == dtype
    torch.testing.assert_close(out, want_out, atol=ATOL[dtype], rtol=ATOL[dtype])
    if return_lse:
        torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


# -- descriptors -----------------------------------------------------------------------------


def _address(server: Server) -> tuple[str, int]:
    url = urlparse(server.url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


def _body(nbytes: int) -> bytes:
    """A /prefill body of about `nbytes`: requests of 64 tokens, 2 heads of 64, bf16."""
    tokens = max(64, nbytes // 768 // 64 * 64)
    q, k, v, q_cu, _ = make_batch(BatchSpec([64] * (tokens // 64)), (2, 64, 64), torch.bfloat16)
    header, chunks = wire.encode({"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu})
    return header + b"".join(bytes(c) for c in chunks)


def _post(server: Server, body: bytes, timeout: float) -> int | str:
    try:
        with httpx.Client(base_url=server.url, timeout=timeout) as c:
            return c.post("/prefill", content=body, headers=OCTET).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


@pytest.mark.slow
def test_running_out_of_descriptors_leaves_the_worker_and_passes(tmp_path):
    """Idle connections hold the server's descriptors until 6, 5 ... 0 are left, and a /prefill
    is sent at each step. Each body is bigger than the last, so its shared memory is new and goes
    to the worker with its descriptor. Requests may fail, but the worker is never taken for
    dead, and once the connections close the server answers 200 again."""
    limit = 160
    with serve(tmp_path, workers=1, header_timeout_s=300, deadline_s=10) as server:
        spid = server.process.pid
        # lowered once started: the server raises its own soft limit and sizes its connection
        # cap from the limit at start, which would keep idle connections from using it all
        resource.prlimit(spid, resource.RLIMIT_NOFILE, (limit, limit))
        worker = server.health()["workers"][0]
        idle: list[socket.socket] = []
        answers: list[tuple[int, int | str]] = []

        def settle(left: int) -> None:
            """Open or close idle connections until the server has `left` descriptors free."""
            stalled = 0
            for _ in range(2 * limit):
                before = open_fds(spid)
                if limit - before > left:
                    idle.append(socket.create_connection(_address(server), timeout=5))
                elif limit - before < left and idle:
                    idle.pop().close()
                else:
                    return
                # until accepted (or accepting fails), or closed
                eventually(lambda b=before: open_fds(spid) != b, 1.5)
                stalled = stalled + 1 if open_fds(spid) == before else 0
                if stalled == 3:
                    return  # the server accepts no more

        try:
            size = 32 << 10
            for left in range(6, -1, -1):  # sizes 32 KiB, 1.1 MiB, 3.3 MiB ... 70 MiB
                settle(left)
                answers.append((limit - open_fds(spid), _post(server, _body(size), timeout=5)))
                size = 2 * size + (1 << 20) + (64 << 10)  # fits no buffer the cache holds
        finally:
            for s in idle:
                s.close()
        freed = time.monotonic()
        answered = eventually(lambda: _post(server, _body(64 << 10), timeout=5) == 200, 30, 0.2)
        again = time.monotonic() - freed if answered else None
        print(f"answers (descriptors left, status): {answers}; 200 again after {again} s")
        assert any(status == 200 for _, status in answers), answers
        assert any(status != 200 for _, status in answers), "descriptors never ran short"
        assert again is not None and again < 5, answers
        now = server.health()["workers"][0]
        assert (now["pid"], now["restarts"], now["alive"]) == (worker["pid"], 0, True), now


# -- orphans ---------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    """No such process, or a zombie (PID 1 here may not reap what it inherits)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow
def test_a_busy_worker_dies_with_a_killed_server(tmp_path):
    with serve(tmp_path, workers=1) as server:
        x = torch.randn(12000, 8, 192).bfloat16()
        tensors = {"q": x, "k": x, "v": x[..., :128].contiguous()}
        tensors["q_cu_seq_lens"] = torch.tensor([0, 12000])
        header, chunks = wire.encode(tensors, {"kernel": "reference", "causal": "false"})
        body = header + b"".join(bytes(c) for c in chunks)
        t = threading.Thread(target=_post, args=(server, body, 120), daemon=True)
        t.start()
        pid = busy_worker(server, 60)["pid"]
        try:
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(10)
            killed = time.monotonic()
            eventually(lambda: _gone(pid), 5)
            took = time.monotonic() - killed
            print(f"orphaned worker gone {took:.3f} s after the server")
            assert _gone(pid) and took < 1.5, f"worker {pid} outlived the server"
        finally:
            if not _gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        t.join(10)
