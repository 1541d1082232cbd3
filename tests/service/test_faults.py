"""Faults: workers killed mid-request, clients vanishing mid-upload and mid-download, a client
dribbling its body. Nothing lost that could be saved, nothing leaked."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import torch

import zen_mla
from tests.batches import BATCH_SPECS, make_batch
from tests.processes import open_fds, rss, wait_for
from tests.service.bodies import OCTET, body_of, slow_tensors
from tests.service.restart import requests_counted
from tests.service.servers import busy_worker, serve, wait_ready


def tree(server) -> list[int]:
    return [server.process.pid] + [w["pid"] for w in server.health()["workers"]]


def fds(pids: list[int]) -> int:
    return sum(open_fds(p) for p in pids)


def rss_bytes(pids: list[int]) -> int:
    return sum(rss(p) for p in pids)


@pytest.mark.slow
def test_a_worker_killed_mid_request_is_retried(tmp_path):
    with serve(tmp_path, workers=1) as server:
        x = slow_tensors(6000)
        results = {}

        def run():
            with server.client() as c:
                body = body_of(x, {"kernel": "reference", "causal": "false"})
                results["r"] = c.post("/prefill", content=body, headers=OCTET)

        pid = server.health()["workers"][0]["pid"]
        t = threading.Thread(target=run)
        t.start()
        assert busy_worker(server)["pid"] == pid  # its body is in and its work handed out
        os.kill(pid, signal.SIGKILL)
        t.join(120)
        assert results["r"].status_code == 200
        from zen_mla import wire

        out, _ = wire.decode(
            torch.frombuffer(bytearray(results["r"].content), dtype=torch.uint8),
            wire.RESPONSE_TENSORS,
        )
        want = zen_mla.ragged_attention(*x.values(), causal=False, kernel="reference")
        torch.testing.assert_close(out["out"], want, atol=1.6e-2, rtol=1.6e-2)
        assert wait_ready(server)["workers"][0]["restarts"] == 1


def test_clients_vanishing_100_times_leak_nothing(server):
    host, port = urlparse(server.url).hostname, urlparse(server.url).port
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (4, 192, 128), torch.bfloat16)
    upload = body_of({"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu})
    big = torch.randn(20000, 4, 192).bfloat16()  # a 20 MB answer for 1 key
    download = body_of(
        {
            "q": big,
            "k": big[:1],
            "v": big[:1],
            "q_cu_seq_lens": torch.tensor([0, 20000]),
            "kv_cu_seq_lens": torch.tensor([0, 1]),
        },
        {"causal": "false"},
    )

    def request_head(n: int) -> bytes:
        return (
            b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            + f"Content-Length: {n}\r\n\r\n".encode()
        )

    def once(i: int) -> None:
        with socket.create_connection((host, port), timeout=30) as s:
            if i % 2:
                s.sendall(request_head(len(upload)) + upload[: len(upload) // 3])
            else:
                s.sendall(request_head(len(download)) + download)
                s.recv(4096)  # the answer has started: go away mid-download

    def all_ended(n: int) -> None:
        """Until the service has ended `n` requests more than before this test (each counted,
        a vanished client's as a 499) and holds none."""
        wait_for(
            lambda: (
                requests_counted(server, ("prefill",), None) >= before + n
                and server.health()["inflight"] == 0
            ),
            60,
            f"the service did not end {n} requests within 60 s",
        )

    before = requests_counted(server, ("prefill",), None)
    once(0), once(1)  # warm the buffer cache
    all_ended(2)
    pids = tree(server)
    shm, fds0, rss0 = set(os.listdir("/dev/shm")), fds(pids), rss_bytes(pids)
    for i in range(100):
        once(i)
    all_ended(102)
    assert tree(server) == pids, "no worker died"
    # an answer's memory goes back once the transport lets go of it, a connection's socket
    # once the hang-up is read: after the request ended
    wait_for(
        lambda: fds(pids) <= fds0 + 4 and set(os.listdir("/dev/shm")) <= shm,
        10,
        "descriptors or shared memory still held 10 s after the requests ended",
    )
    assert set(os.listdir("/dev/shm")) <= shm
    assert fds(pids) <= fds0 + 4, "descriptors leaked"
    grown = rss_bytes(pids) - rss0
    assert grown < 256 << 20, f"memory grew by {grown >> 20} MiB"
    with server.client() as c:
        assert c.post("/prefill", content=upload, headers=OCTET).status_code == 200


@pytest.mark.slow
def test_a_client_dribbling_its_body_is_cut_off_at_the_deadline(tmp_path):
    """The deadline bounds a body too, with the minimum rate off (test_abuse.py has it on)."""
    with serve(tmp_path, workers=1, deadline_s=2, min_body_rate=0) as server:
        host, port = urlparse(server.url).hostname, urlparse(server.url).port
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(
                b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                b"Content-Length: 1000000\r\n\r\n"
            )
            t0 = time.monotonic()
            s.settimeout(0.2)
            answer = b""
            while time.monotonic() - t0 < 15 and not answer:
                try:
                    s.sendall(b"\0")
                    answer = s.recv(65536)
                except TimeoutError:
                    continue
        assert answer.startswith(b"HTTP/1.1 504"), answer[:200]
        assert time.monotonic() - t0 < 5
        assert server.health()["inflight"] == 0
