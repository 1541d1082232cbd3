"""Clients that are slow, idle or lie (docs/protocol.md, "Limits"), against real servers: none of
them keeps the service from others, and every refusal arrives as a readable problem+json."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.processes import eventually, rss, wait_for
from tests.service.bodies import OCTET, body_of, good_tensors, slow_tensors
from tests.service.raw import (
    MIB,
    address,
    assert_problem,
    prefill_head,
    read_answer,
    send_quietly,
)
from tests.service.servers import ROOT, Server, serve, server_fixture, wait_draining

# -- one server per parser: header cap, header timeout, connection cap, early answers ---------

LIMITS = {
    "max_header_bytes": 16384,
    "header_timeout_s": 1.0,
    "max_connections": 6,
    "max_body_bytes": MIB,
}


@server_fixture(scope="module", params=["httptools", "h11"])
def guarded(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp(request.param)
    with serve(tmp, workers=1, http=request.param, **LIMITS) as s:
        yield s


@pytest.mark.slow
def test_headers_over_the_cap_get_431_at_once(guarded):
    with socket.create_connection(address(guarded), timeout=10) as s:
        t0 = time.monotonic()
        big = b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (16 * MIB)
        sender = threading.Thread(target=send_quietly, args=(s, big))
        sender.start()
        answer = read_answer(s, 10)
        waited = time.monotonic() - t0
        sender.join(30)
    assert_problem(answer, 431)
    assert waited < 3, f"431 after {waited:.2f} s"
    with guarded.client() as c:  # a head under the cap is fine
        assert c.get("/health/live", headers={"X-Big": "a" * 8000}).status_code == 200


@pytest.mark.slow
def test_idle_and_slowloris_connections_get_408_and_are_closed(guarded):
    results: dict[str, tuple[bytes, float]] = {}

    def idle() -> None:
        with socket.create_connection(address(guarded), timeout=10) as s:
            t0 = time.monotonic()
            results["idle"] = read_answer(s, 10), time.monotonic() - t0

    def slowloris() -> None:
        with socket.create_connection(address(guarded), timeout=10) as s:
            t0 = time.monotonic()
            s.sendall(b"POST /prefill HTTP/1.1\r\nHost: x\r\n")
            answer = b""
            for _ in range(100):  # a header byte every 0.1 s, for 10 s at most
                send_quietly(s, b"X")
                answer = read_answer(s, 0.1)
                if answer:
                    answer += read_answer(s, 2)
                    break
            results["slowloris"] = answer, time.monotonic() - t0

    def after_keep_alive() -> None:
        with socket.create_connection(address(guarded), timeout=10) as s:
            s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            first = b""
            while b'"alive"}' not in first:
                first += s.recv(65536)
            t0 = time.monotonic()
            s.sendall(b"GET /health/live HTTP/1.1\r\n")  # and never the rest
            results["after_keep_alive"] = read_answer(s, 10), time.monotonic() - t0

    threads = [threading.Thread(target=f) for f in (idle, slowloris, after_keep_alive)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for name, (answer, lived) in results.items():
        assert_problem(answer, 408)
        assert lived < 3, f"{name}: closed after {lived:.2f} s (header timeout 1 s)"
    assert set(results) == {"idle", "slowloris", "after_keep_alive"}


@pytest.mark.slow
def test_connections_over_the_cap_displace_the_idle_one(guarded):
    """At the cap, a new connection takes the place of the one idle longest (408, closed)."""
    cap = LIMITS["max_connections"]
    held = [socket.create_connection(address(guarded), timeout=10) for _ in range(cap)]
    try:
        time.sleep(0.2)
        with socket.create_connection(address(guarded), timeout=10) as extra:
            t0 = time.monotonic()
            extra.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = extra.recv(65536)
            waited = time.monotonic() - t0
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert waited < 1
        problem = assert_problem(read_answer(held[0], 5), 408)
        assert "connection cap" in problem["detail"]
    finally:
        for s in held:
            s.close()
    wait_for(lambda: httpx.get(guarded.url + "/health/live").status_code == 200, 10, "served")


@pytest.mark.slow
@pytest.mark.parametrize("connection", ["close", "keep-alive"])
def test_an_early_413_reaches_the_client_whole(guarded, connection):
    """32 MiB over a 1 MiB limit: the answer is readable, not a reset, also with
    `Connection: close` (the connection closes after it either way)."""
    body = bytes(32 * MIB)
    for _ in range(3):
        with guarded.client() as c:
            r = c.post("/prefill", content=body, headers=OCTET | {"Connection": connection})
        assert r.status_code == 413, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert r.headers["connection"] == "close"
    with socket.create_connection(address(guarded), timeout=10) as s:
        head = prefill_head(len(body), b"Connection: close\r\n")
        sender = threading.Thread(target=send_quietly, args=(s, head + body))
        sender.start()
        answer = read_answer(s, 10)
        sender.join(30)
    assert_problem(answer, 413)


# -- slow bodies, announced bytes ----------------------------------------------------------


@pytest.mark.slow
def test_slow_uploads_do_not_lock_out_others(tmp_path):
    """Eight bodies of 8 MiB sent at 1 KiB/s fill what was the whole queue (8): a legitimate
    request is still served at once, and the slow ones are cut off with 408."""
    grace = 5.0
    with serve(tmp_path, workers=1, max_queue=8, body_grace_s=grace) as server:
        answers: dict[int, tuple[bytes, float]] = {}

        def slow(i: int) -> None:
            with socket.create_connection(address(server), timeout=10) as s:
                t0 = time.monotonic()
                s.sendall(prefill_head(8 * MIB))
                answer = b""
                for _ in range(30):  # 1 KiB a second, 30 s at most
                    send_quietly(s, bytes(1024))
                    answer = read_answer(s, 1.0)
                    if answer:
                        break
                lived = time.monotonic() - t0
                # the answer's head may come in one window and its body in the next: read on
                # until the server closes the connection
                answers[i] = answer + read_answer(s, 5.0), lived

        threads = [threading.Thread(target=slow, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        wait_for(lambda: server.health()["inflight"] == 8, 10, "eight uploads in")
        t0 = time.monotonic()
        with server.client() as c:
            r = c.post("/prefill", content=body_of(good_tensors()), headers=OCTET)
        waited = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert waited < 3, f"a legitimate request waited {waited:.2f} s"
        assert server.health()["uploads"] == 8  # they were all still there
        for t in threads:
            t.join(60)
        assert sorted(answers) == list(range(8))
        for answer, lived in answers.values():
            assert "bytes/s" in assert_problem(answer, 408)["detail"]
            assert grace < lived < grace + 5, lived
        assert server.health()["inflight"] == 0


@pytest.mark.slow
def test_announced_bytes_that_do_not_come_commit_no_memory(tmp_path):
    """Four 1 GiB announcements with a 3 GiB budget: all are admitted (the budget holds bytes
    that came, not bytes announced) and hold no memory; the event loop stays responsive; a
    legitimate request is served beside them; the four get 408."""
    grace = 4.0
    with serve(
        tmp_path, workers=1, max_body_bytes=1 << 30, max_inflight_bytes=3 << 30, body_grace_s=grace
    ) as server:
        pid = server.process.pid
        before = rss(pid)
        socks = [socket.create_connection(address(server), timeout=10) for _ in range(4)]
        try:
            for s in socks:
                s.sendall(prefill_head(1 << 30) + bytes(1000))
            wait_for(lambda: server.health()["inflight"] == 4, 10, "four admitted")
            assert server.health()["inflight_bytes"] < 4 * (17 << 20)  # a window each
            with server.client() as c:
                r = c.post("/prefill", content=body_of(good_tensors()), headers=OCTET)
            assert r.status_code == 200, r.text
            t0 = time.monotonic()
            server.health()
            health_s = time.monotonic() - t0
            grown = rss(pid) - before
            answers = [read_answer(s, grace + 5) for s in socks]
        finally:
            for s in socks:
                s.close()
        assert grown < 128 * MIB, f"the server grew by {grown / MIB:.0f} MiB"
        assert health_s < 0.5
        for answer in answers:
            assert_problem(answer, 408)


# -- token, health ---------------------------------------------------------------------------


@pytest.mark.slow
def test_an_empty_token_is_refused_at_start():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEN_MLA_")}
    done = subprocess.run(
        [sys.executable, "-c", "from service.cli import main; main()", "serve", "--port", "0"],
        cwd=ROOT,
        env=env | {"ZEN_MLA_API_TOKEN": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "ZEN_MLA_API_TOKEN" in done.stderr and "empty" in done.stderr


def test_head_health_answers_as_get(server):
    with server.client() as c:
        got, head = c.get("/health"), c.head("/health")
        assert head.status_code == got.status_code == 200
        assert head.content == b""
        assert head.headers["content-type"] == "application/json"
        assert c.head("/health/live").status_code == 200


@pytest.mark.slow
def test_health_is_503_while_no_worker_is_alive(tmp_path):
    with serve(tmp_path, workers=1) as server:
        pid = server.health()["workers"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        seen = []
        with server.client() as c:

            def replaced() -> bool:
                r = c.get("/health")
                seen.append((r.status_code, r.json()["status"]))
                return r.status_code == 200 and r.json()["workers"][0]["pid"] != pid

            eventually(replaced, 60, 0.02)
            assert c.head("/health").status_code == 200
        assert (503, "no_worker") in seen, seen
        assert all(code == 503 for code, word in seen if word == "no_worker"), seen
        assert seen[-1] == (200, "ok"), seen[-1]


# -- descriptors -----------------------------------------------------------------------------


@pytest.mark.slow
def test_fd_limit_is_raised_and_connections_stop_short_of_it(tmp_path):
    """Soft 200, hard 400: the server raises its soft limit to 400 and, keeping 250 for the
    pool, holds 150 connections at most: each one past them takes the place of the one idle
    longest (which gets 408) or gets 503, and the pool still works."""
    with serve(tmp_path, workers=1, fd_reserve=250, nofile=(200, 400)) as server:
        limits = Path(f"/proc/{server.process.pid}/limits").read_text()
        soft, hard = next(
            line.split()[3:5] for line in limits.splitlines() if line.startswith("Max open files")
        )
        assert (soft, hard) == ("400", "400")
        held = []
        refused = 0
        try:
            for _ in range(200):
                s = socket.create_connection(address(server), timeout=10)
                held.append(s)
            time.sleep(0.5)
            for s in held:
                s.settimeout(0.01)
                with contextlib.suppress(TimeoutError, ConnectionError):
                    refused += s.recv(12)[:12] in (b"HTTP/1.1 503", b"HTTP/1.1 408")
        finally:
            for s in held:
                s.close()
        assert refused >= 50, refused  # 200 made, 150 held at most
        wait_for(lambda: server.health()["status"] == "ok", 10, "healthy")
        with server.client() as c:
            r = c.post("/prefill", content=body_of(good_tensors()), headers=OCTET)
        assert r.status_code == 200, r.text
        assert "Too many open files" not in server.logs()


# -- drain -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_503_while_draining_reaches_a_connection_close_client(tmp_path):
    with serve(tmp_path, workers=1, drain_timeout_s=60) as server:
        results = {}

        def run():
            with server.client() as c:
                body = body_of(slow_tensors(6000), {"kernel": "reference", "causal": "false"})
                results["slow"] = c.post("/prefill", content=body, headers=OCTET)

        t = threading.Thread(target=run)
        t.start()
        wait_for(lambda: server.health()["inflight"] >= 1, 30, "slow request in")
        server.process.send_signal(signal.SIGTERM)
        wait_draining(server)
        body = bytes(32 * MIB)
        for _ in range(3):
            with server.client() as c:
                r = c.post("/prefill", content=body, headers=OCTET | {"Connection": "close"})
            assert r.status_code == 503, r.text
            assert r.headers["content-type"] == "application/problem+json"
            with socket.create_connection(address(server), timeout=10) as s:
                head = prefill_head(len(body), b"Connection: close\r\n")
                sender = threading.Thread(target=send_quietly, args=(s, head + body))
                sender.start()
                answer = read_answer(s, 10)
                sender.join(30)
            assert_problem(answer, 503)
        t.join(120)
        assert results["slow"].status_code == 200
        assert server.process.wait(timeout=60) == 0


@pytest.mark.slow
def test_the_header_timeout_spares_a_pipelined_request_being_answered(tmp_path):
    """A second request pipelined behind a first starts when the first is answered; computing
    it for longer than the header timeout is not a late header."""
    slow = body_of(slow_tensors(6000), {"kernel": "reference", "causal": "false"})
    with (
        serve(tmp_path, workers=1, header_timeout_s=1.0) as server,
        socket.create_connection(address(server), timeout=10) as s,
    ):
        s.sendall(
            b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n"
            + prefill_head(len(slow), b"Connection: close\r\n")
            + slow
        )
        answer = read_answer(s, 60)
    assert b"HTTP/1.1 408" not in answer
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 2, answer[:500]
