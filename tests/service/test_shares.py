"""A fair share for every client (docs/clients.md), on a real server:
one client taking every upload slot or every queue place keeps neither a small body nor another
client out, an upload keeping up with the advertised minimum rate is never cut off, and queued
work takes turns between clients. The attacks come from 127.0.0.1, the other client from
127.0.0.2 (`attacks.OTHER`): two clients, as two hosts would be."""

from __future__ import annotations

import http.client
import multiprocessing
import os
import select
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch

import zen_mla
from tests.processes import wait_for
from tests.service.attacks import (
    LOCKOUT_S,
    legitimate,
    other_client,
    silent_heads,
    trickle,
)
from tests.service.bodies import OCTET, body_of
from tests.service.raw import MIB, address, prefill_head
from tests.service.restart import requests_counted
from tests.service.servers import Server, serve, server_fixture
from zen_mla.client import PrefillClient

pytestmark = pytest.mark.slow


@server_fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """4 upload slots, a 1 s grace, the default 1 MB/s minimum rate and 8 queue places."""
    with serve(
        tmp_path_factory.mktemp("shares"),
        workers=1,
        max_uploads=4,
        body_grace_s=1.0,
        max_body_bytes=256 * MIB,
        max_inflight_bytes=1024 * MIB,
        deadline_s=60,
    ) as s:
        yield s


def _tensors(tokens: int, heads: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, heads, 192, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(tokens, heads, 128, generator=g).bfloat16()
    return {"q": q, "k": k, "v": v, "q_cu_seq_lens": torch.tensor([0, tokens], dtype=torch.int32)}


def _expected(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return zen_mla.ragged_attention(t["q"], t["k"], t["v"], t["q_cu_seq_lens"])


def _post_until_answered(client: httpx.Client, body: bytes, seconds: float) -> httpx.Response:
    """POST /prefill, again after each 429 (as a client honouring Retry-After sooner would),
    until answered otherwise or `seconds` passed."""
    end = time.monotonic() + seconds
    while True:
        r = client.post("/prefill", content=body, headers=OCTET, timeout=seconds)
        if r.status_code != 429 or time.monotonic() > end:
            return r
        time.sleep(0.05)


def _out(content: bytes) -> torch.Tensor:
    return safetensors.torch.load(content)["out"]


# -- 1: slots held by uploads fast enough to keep them ------------------------------------------


def test_uploads_keeping_every_slot_leave_small_bodies_and_other_clients_in(door):
    """32 uploads at 2.3 MB/s (over twice the minimum, so none was ever displaced) held every
    slot: a 1 KiB /prefill got 429 for as long as they sent. Now a small body needs no slot, and
    another client's upload takes one within its share; the uploads themselves are not cut."""
    small = _tensors(1, 2, seed=1)
    small_body = body_of(small)
    assert len(small_body) < 4096
    before_408 = requests_counted(door, ("prefill",), 408)
    stop = threading.Event()
    attack = threading.Thread(target=trickle, args=(door, 200 * MIB, 4, 2.3e6, stop), daemon=True)
    attack.start()
    try:
        # every slot taken before the others come
        wait_for(lambda: door.health()["uploads"] >= 4, 10, lambda: str(door.health()))
        with door.client() as same_address:  # the attacker's own address: a small body
            t0 = time.monotonic()
            r = _post_until_answered(same_address, small_body, LOCKOUT_S)
            assert r.status_code == 200, r.text
            assert time.monotonic() - t0 < 2, "a small body waited"
            assert torch.equal(_out(r.content), _expected(small))
        assert legitimate(door) < LOCKOUT_S  # a 400 KB upload from another client
        assert door.health()["uploads"] >= 4  # the attack kept its slots all along
    finally:
        stop.set()
        attack.join(30)
    assert requests_counted(door, ("prefill",), 408) == before_408


# -- 2: a legitimate upload displaced -----------------------------------------------------------


def _paced_post(server: Server, body: bytes, rate: float) -> tuple[int, bytes, float]:
    """POST `body` to /prefill at `rate` bytes/s, again after a 429 (which comes before the body
    is read), within LOCKOUT_S; (status, body, seconds) of the last try."""
    end = time.monotonic() + LOCKOUT_S
    while True:
        status, content, took = _paced_post_once(server, body, rate)
        if status != 429 or time.monotonic() > end:
            return status, content, took
        time.sleep(0.2)


def _paced_post_once(server: Server, body: bytes, rate: float) -> tuple[int, bytes, float]:
    host, port = address(server)
    conn = http.client.HTTPConnection(host, port, timeout=60)
    t0 = time.monotonic()
    try:
        conn.putrequest("POST", "/prefill")
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        sent, step = 0, 32 << 10
        while sent < len(body):
            if select.select([conn.sock], [], [], 0)[0]:
                break  # answered before the whole body came (a 429, a 408)
            ahead = sent - (time.monotonic() - t0) * rate
            if ahead > 0:
                time.sleep(ahead / rate)
            conn.send(body[sent : sent + step])
            sent += step
        r = conn.getresponse()
        return r.status, r.read(), time.monotonic() - t0
    except (ConnectionError, BrokenPipeError) as exc:  # cut off mid-body: say how
        return 0, repr(exc).encode(), time.monotonic() - t0
    finally:
        conn.close()


def test_an_upload_above_the_minimum_rate_is_never_displaced(door):
    """A 6 MB body sent at 1.5 MB/s (above the advertised 1 MB/s; alone: a 200 in ~4 s) got 408
    after 2.4 s "for a faster one" while another upload kept coming. Uploads that fall behind
    the minimum are still displaced for newcomers (here, silent ones take each other's slots)."""
    tensors = _tensors(384, 16, seed=2)
    body = body_of(tensors)
    assert len(body) > 6 * MIB
    stop = threading.Event()
    # from the upload's own address: no share of another client's helps it, only the rule
    attack = threading.Thread(
        target=silent_heads, args=(door, prefill_head(64 * MIB), 8, stop), daemon=True
    )
    attack.start()
    try:
        time.sleep(1.0)
        status, content, took = _paced_post(door, body, 1.5e6)
    finally:
        stop.set()
        attack.join(30)
    assert status == 200, (status, content[:300], took)
    assert torch.equal(_out(content), _expected(tensors))


# -- 3: a share of the queue and turns in it ----------------------------------------------------


def _timing(r: httpx.Response, part: str) -> float:
    """Seconds of `part` ("queue", "compute") in the answer's Server-Timing header."""
    for entry in r.headers["server-timing"].split(","):
        name, _, dur = entry.strip().partition(";dur=")
        if name == part:
            return float(dur) / 1e3
    raise AssertionError(f"no {part} in {r.headers['server-timing']!r}")


def test_a_flood_of_queued_work_delays_another_client_by_one_job_at_most(door):
    """Eight connections kept the queue full of long calls: another client's calls got
    429 or waited behind the whole queue. Now it takes a place within its share, and its work
    takes its turn: it waits in the queue for at most the flood's job then running and one more
    (the flood is one client), as the service's own Server-Timing says (its queue time against
    the flood's compute times; behind the whole queue it would be four to eight of them)."""
    # 16384 tokens of 2 heads: the compute of 4096 of 16 heads twice over in half its bytes.
    # With 4096 x 16 (64 MiB) the uploads only just outran the work on 2 vCPUs: the queue took
    # 20 s to hold 4, and in one CI run never did within 60 s; this one holds 4 within 3 s.
    big = body_of(_tensors(16384, 2, seed=3))
    small = _tensors(64, 16, seed=4)
    small_body = body_of(small)
    computed: list[float] = []  # the flood's jobs' compute seconds
    stop = threading.Event()

    def flood() -> None:
        with door.client() as c:
            while not stop.is_set():
                r = c.post("/prefill", content=big, headers=OCTET, timeout=120)
                if r.status_code == 200:
                    computed.append(_timing(r, "compute"))
                elif r.status_code == 429:
                    time.sleep(0.01)
                elif r.status_code == 408 and "the body came slower" in r.text:
                    # eight threads of this process sending big bodies on 2 vCPUs: one starved
                    # past the door's 1 s grace is refused as any slow client is (seen once in
                    # a full run); the flood goes on
                    continue
                else:
                    raise AssertionError(r.text)

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        # the flood holds half the queue at least (on a 16-core host its calls end about as
        # fast as it uploads them, and the queue seldom fills)
        wait_for(lambda: door.health()["queued"] >= 4, 60, lambda: str(door.health()))
        queued = []
        with other_client(door) as c:
            for _ in range(4):
                t0 = time.monotonic()
                r = _post_until_answered(c, small_body, LOCKOUT_S)
                assert r.status_code == 200, r.text
                assert time.monotonic() - t0 < LOCKOUT_S
                assert torch.equal(_out(r.content), _expected(small))
                queued.append(_timing(r, "queue"))
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    longest = max(computed)
    print(
        f"\nthe other client queued {[f'{q:.2f}' for q in queued]} s; the flood's jobs computed "
        f"{min(computed):.2f}-{longest:.2f} s"
    )
    assert max(queued) <= 2 * longest + 0.05, (queued, longest)


# -- 3 on the region socket: clients told apart by uid -------------------------------------------


def _region_calls_as(uid: int, url: str, tensors, n: int, conn) -> None:
    """In a forked child: `n` region-socket calls as `uid` (SO_PEERCRED tells the service), each
    retried on 429 within LOCKOUT_S; sends back [(out, seconds)] or the error's repr. One call is
    made as root first (then "ready", and it waits for "go"), so that every module it needs is
    loaded before the child loses the right to read root's files."""
    try:
        torch.set_num_threads(1)
        with PrefillClient(url, shared_memory=True, timeout=LOCKOUT_S) as warm:
            warm.prefill(*tensors)
        conn.send("ready")
        conn.recv()
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        got = []
        with PrefillClient(url, shared_memory=True, timeout=LOCKOUT_S, retries=100) as client:
            for _ in range(n):
                t0 = time.monotonic()
                out = client.prefill(*tensors)
                # as numpy: torch's own pickling of tensors would move them to shared memory
                got.append((out.float().numpy(), time.monotonic() - t0))
        conn.send(got)
    except BaseException as exc:  # reported to the parent, never raised in the fork
        conn.send(repr(exc))
    finally:
        conn.close()
        os._exit(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="a client of another uid needs root to become one")
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the client pins its regions through CUDA, which a forked child cannot use",
)
def test_a_region_caller_of_another_uid_gets_its_answers_through_a_flood(tmp_path):
    """Eight region-socket connections kept the queue full of 4096-token calls: a region caller
    of another uid got 0 of 4 answers (QueueFullError after 3 s). Clients on the region socket
    are told apart by the peer's uid: it takes a place within its share and its turn."""
    folder = Path(tempfile.mkdtemp(prefix="zen-mla-shares-"))  # not under root's 0700 tmp
    folder.chmod(0o755)
    sock = folder / "regions.sock"
    big = _tensors(4096, 16, seed=5)
    small = _tensors(32, 16, seed=6)
    args = (small["q"], small["k"], small["v"], small["q_cu_seq_lens"])
    with serve(tmp_path, workers=1, shm_socket=str(sock), deadline_s=60) as server:
        sock.chmod(0o666)  # another uid may connect (the service makes it 0600)
        stop = threading.Event()
        done = [0]

        def flood() -> None:
            with PrefillClient(server.url, shared_memory=True, retries=1000) as c:
                while not stop.is_set():
                    c.prefill(big["q"], big["k"], big["v"], big["q_cu_seq_lens"])
                    done[0] += 1

        parent, child = multiprocessing.get_context("fork").Pipe()
        proc = multiprocessing.get_context("fork").Process(
            target=_region_calls_as, args=(65534, server.url, args, 4, child)
        )
        proc.start()  # before the flood's threads: a fork copies no running thread
        child.close()
        assert parent.poll(60) and parent.recv() == "ready"
        threads = [threading.Thread(target=flood, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: server.health()["queued"] >= 8, 60, lambda: str(server.health()))
            parent.send("go")
            assert parent.poll(120), "the other uid's calls did not end"
            got = parent.recv()
            proc.join(10)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
    assert not isinstance(got, str), got
    expected = zen_mla.ragged_attention(*args)
    assert [torch.equal(torch.from_numpy(out), expected.float()) for out, _ in got] == [True] * 4
    print(f"\nanother uid's calls through the flood: {[f'{s:.2f} s' for _, s in got]}")
    assert max(s for _, s in got) < LOCKOUT_S
