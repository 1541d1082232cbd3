"""Every status code of the contract, provoked for real; the service healthy after each."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
import torch

import zen_mla
from tests.processes import wait_for
from tests.service.bodies import OCTET, body_of, good_tensors, slow_tensors
from tests.service.servers import Server, serve, wait_draining, wait_ready
from zen_mla.client import PrefillClient


def prefill_once(url: str, tensors: dict, **kwargs):
    with PrefillClient(url, **{k: kwargs.pop(k) for k in ("token", "retries") if k in kwargs}) as c:
        return c.prefill(**tensors, **kwargs)


def assert_problem(r: httpx.Response, status: int, **fields: str):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["status"] == status and problem["title"] and problem["detail"]
    assert problem["type"].startswith("urn:zen-mla:problem:")
    for key, part in fields.items():
        assert part in str(problem[key]), problem
    return problem


def replaced(server: Server, pid: int, timeout: float = 60) -> dict:
    """`/health`'s entry for the worker once it is alive in a process other than `pid` (the
    service stopped `pid` and started another)."""

    def other() -> dict | None:
        w = server.health()["workers"][0]
        return w if w["alive"] and w["pid"] != pid else None

    return wait_for(
        other,
        timeout,
        lambda: f"worker {pid} not replaced within {timeout} s: {server.health()['workers'][0]}",
        0.1,
    )


def assert_healthy(server):
    health = server.health()
    assert health["status"] == "ok", health
    assert all(w["alive"] for w in health["workers"])


def test_400_unreadable_body(server):
    with server.client() as c:
        for junk in (b"", b"1234", struct.pack("<Q", 5) + b"{nope", struct.pack("<Q", 1 << 40)):
            assert_problem(c.post("/prefill", content=junk, headers=OCTET), 400)
        lying = body_of(good_tensors())
        n = struct.unpack("<Q", lying[:8])[0]
        header = json.loads(lying[8 : 8 + n])
        header["q"]["data_offsets"][1] += 1 << 30  # past the end
        text = json.dumps(header).encode()
        bad = struct.pack("<Q", len(text)) + text + lying[8 + n :]
        assert_problem(c.post("/prefill", content=bad, headers=OCTET), 400, tensor="q")
    assert_healthy(server)


def test_411_without_content_length(server):
    with server.client() as c:
        r = c.post("/prefill", content=iter([body_of(good_tensors())]), headers=OCTET)
    assert_problem(r, 411)
    assert_healthy(server)


def test_413_is_answered_before_the_body_is_sent(server):
    host, port = urlparse(server.url).hostname, urlparse(server.url).port
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(
            b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            b"Content-Length: 107374182400\r\n\r\n"  # 100 GiB announced, nothing sent
        )
        answer = s.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 413"), answer
    assert "application/problem+json" in answer
    assert_healthy(server)


def test_415_wrong_content_type(server):
    with server.client() as c:
        r = c.post(
            "/prefill",
            content=body_of(good_tensors()),
            headers={"Content-Type": "application/json"},
        )
    assert_problem(r, 415)
    assert_healthy(server)


@pytest.mark.parametrize(
    ("change", "meta", "tensor"),
    [
        ({"v": torch.randn(3, 2, 32).bfloat16()}, None, "v"),
        ({"q": torch.randn(235, 2, 64)}, None, "k, v"),
        ({"q_cu_seq_lens": torch.tensor([0, 5, 3])}, None, "q_cu_seq_lens"),
        ({"extra": torch.zeros(1)}, None, "body"),
        ({}, {"retrun_lse": "true"}, "__metadata__"),
        ({}, {"causal": "yes"}, "__metadata__.causal"),
        ({}, {"scale": "-1"}, "scale"),
        ({}, {"kernel": "cuda"}, "kernel"),
    ],
)
def test_422_names_the_tensor(server, change, meta, tensor):
    tensors = good_tensors() | change
    with server.client() as c:
        r = c.post("/prefill", content=body_of(tensors, meta), headers=OCTET)
    assert_problem(r, 422, tensor=tensor)
    assert_healthy(server)


def test_422_missing_tensor_and_work_cap(server):
    tensors = good_tensors()
    del tensors["k"]
    with server.client() as c:
        assert_problem(c.post("/prefill", content=body_of(tensors), headers=OCTET), 422, tensor="k")
        # 1 x 20000 tokens, 1 head, full: H * Dqk * pairs = 7.7e10, over the fixture's 2^36
        big = torch.zeros(20000, 1, 192).bfloat16()
        over = {"q": big, "k": big, "v": big[..., :128], "q_cu_seq_lens": torch.tensor([0, 20000])}
        r = c.post("/prefill", content=body_of(over, {"causal": "false"}), headers=OCTET)
        assert_problem(r, 422, tensor="work", expected=str(1 << 36))
    with PrefillClient(server.url) as client, pytest.raises(zen_mla.InvalidInputError) as info:
        client.prefill(big, big, big[..., :128], torch.tensor([0, 20000]), causal=False)
    assert info.value.name == "work"
    assert_healthy(server)


@pytest.mark.slow
def test_401_token(tmp_path):
    with serve(tmp_path, workers=1, api_token="s3cret") as server:
        body = body_of(good_tensors())
        with server.client() as c:
            for auth in (None, "Bearer wrong", "Bearer", "Basic czNjcmV0"):
                headers = OCTET | ({"Authorization": auth} if auth else {})
                r = c.post("/prefill", content=body, headers=headers)
                assert_problem(r, 401)
                assert r.headers["www-authenticate"].startswith("Bearer"), auth
            good = OCTET | {"Authorization": "Bearer s3cret"}
            assert c.post("/prefill", content=body, headers=good).status_code == 200
            assert c.get("/health").status_code == 200  # health stays open
        with pytest.raises(zen_mla.UnauthorizedError):
            prefill_once(server.url, good_tensors())
        out = prefill_once(server.url, good_tensors(), token="s3cret")
        assert out.shape == (sum([5, 64, 1, 33, 130]), 2, 32)


@pytest.mark.slow
def test_429_queue_full_then_retried(tmp_path):
    with serve(tmp_path, workers=1, max_queue=1) as server:
        slow = body_of(slow_tensors(), {"kernel": "reference", "causal": "false"})
        results = {}

        def hold():
            with server.client() as c:
                results["slow"] = c.post("/prefill", content=slow, headers=OCTET)

        t = threading.Thread(target=hold)
        t.start()
        # its body is in: an upload holds no queue place
        wait_for(lambda: server.health()["queued"] >= 1, 30, "the slow request never queued", 0.02)
        with server.client() as c:
            r = c.post("/prefill", content=body_of(good_tensors()), headers=OCTET)
        assert_problem(r, 429)
        assert int(r.headers["retry-after"]) >= 1
        # the client waits out Retry-After and gets through once the slow one is done
        out = prefill_once(server.url, good_tensors(), retries=30)
        t.join(120)
        assert results["slow"].status_code == 200
        assert out.shape[0] == 233
        assert_healthy(server)


@pytest.mark.slow
def test_504_deadline_abandons_the_work_and_frees_the_worker(tmp_path):
    # The deadline leaves ample time (3 s) for the upload and the hand-over to the worker even
    # on a loaded machine, and ends far before the work would (~12 s): the worker is busy with
    # it when the deadline passes, whatever the load (at 1 s it once passed before a worker took
    # the work, and then none was replaced).
    with serve(tmp_path, workers=1, deadline_s=3.0) as server:
        pid = server.health()["workers"][0]["pid"]
        t0 = time.monotonic()
        with server.client() as c:
            r = c.post(
                "/prefill",
                content=body_of(slow_tensors(16000), {"kernel": "reference", "causal": "false"}),
                headers=OCTET,
            )
        assert_problem(r, 504)
        assert time.monotonic() - t0 < 12
        w = replaced(server, pid)  # the busy worker was stopped and replaced
        assert w["restarts"] == 1
        with pytest.raises(zen_mla.DeadlineExceededError):
            prefill_once(server.url, slow_tensors(16000), kernel="reference", causal=False)
        assert replaced(server, w["pid"])["restarts"] == 2  # and again
        wait_ready(server)
        assert prefill_once(server.url, good_tensors()).shape[0] == 233
        assert_healthy(server)


@pytest.mark.slow
def test_500_when_workers_keep_dying(tmp_path):
    with serve(tmp_path, workers=1) as server:
        results = {}

        def run():
            with server.client() as c:
                body = body_of(slow_tensors(8000), {"kernel": "reference", "causal": "false"})
                results["r"] = c.post("/prefill", content=body, headers=OCTET)

        t = threading.Thread(target=run)
        t.start()
        killed = set()
        deadline = time.monotonic() + 120
        while t.is_alive() and time.monotonic() < deadline:
            w = server.health()["workers"][0]
            if w["state"] == "busy" and w["pid"] not in killed:  # it holds the work
                os.kill(w["pid"], signal.SIGKILL)
                killed.add(w["pid"])
            time.sleep(0.02)
        t.join(60)
        assert len(killed) == 2
        problem = assert_problem(results["r"], 500, detail="died twice")
        assert problem["type"].endswith("KernelError")
        wait_ready(server)
        assert prefill_once(server.url, good_tensors()).shape[0] == 233


@pytest.mark.slow
def test_503_while_draining_and_in_flight_work_finishes(tmp_path):
    with serve(tmp_path, workers=1, drain_timeout_s=60) as server:
        results = {}

        def run():
            with server.client() as c:
                body = body_of(slow_tensors(6000), {"kernel": "reference", "causal": "false"})
                results["slow"] = c.post("/prefill", content=body, headers=OCTET)

        with server.client() as c:  # a keep-alive connection opened before the drain
            assert c.get("/health/live").status_code == 200
            t = threading.Thread(target=run)
            t.start()
            # in flight (else: answered at once, or it never came)
            wait_for(lambda: server.health()["inflight"] >= 1, 30, lambda: str(results), 0.02)
            server.process.send_signal(signal.SIGTERM)
            wait_draining(server)
            r = c.post("/prefill", content=body_of(good_tensors()), headers=OCTET)
            assert_problem(r, 503)
            assert "retry-after" in r.headers
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "draining"
        t.join(120)
        assert results["slow"].status_code == 200
        assert server.process.wait(timeout=60) == 0


def test_client_disconnect_frees_the_work(server):
    """Disconnect mid-upload and while waiting: no request stays in flight."""
    host, port = urlparse(server.url).hostname, urlparse(server.url).port
    body = body_of(good_tensors())
    for _ in range(5):
        with socket.create_connection((host, port)) as s:
            s.sendall(
                b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body[: len(body) // 2]
            )
    wait_for(lambda: not server.health()["inflight"], 30, "the cut uploads still in flight")
    assert_healthy(server)


def test_metrics_and_openapi(server):
    with server.client() as c:
        r = c.post("/prefill", content=body_of(good_tensors()), headers=OCTET)
        assert r.status_code == 200, r.text
        text = c.get("/metrics").text
        spec = c.get("/openapi.json").json()
    for name in (
        "zen_mla_requests_total",
        "zen_mla_request_seconds_bucket",
        "zen_mla_queue_depth",
        "zen_mla_uploads",
        "zen_mla_workers_alive",
        "zen_mla_received_bytes_total",
        "zen_mla_tokens_total",
    ):
        assert name in text
    assert 'zen_mla_requests_total{route="prefill",status="200"}' in text
    assert 'le="60"' in text
    body = spec["paths"]["/prefill"]["post"]["requestBody"]["content"]
    assert "application/octet-stream" in body
    assert (
        "application/problem+json"
        in spec["paths"]["/prefill"]["post"]["responses"]["422"]["content"]
    )
