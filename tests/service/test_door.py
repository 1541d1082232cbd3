"""One door for every body (docs/protocol.md, "Limits"), attacked on real servers as a slow, silent
or lying client would: while any one attack runs, a legitimate request is answered correctly within
15 s."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch

from tests.processes import wait_for
from tests.service.attacks import (
    LOCKOUT_S,
    Latencies,
    during,
    legitimate,
    silent_heads,
    trickle,
)
from tests.service.bodies import OCTET, body_of, good_tensors, slow_tensors
from tests.service.raw import (
    MIB,
    address,
    assert_problem,
    prefill_head,
    read_answer,
)
from tests.service.restart import requests_counted
from tests.service.servers import Server, serve, server_fixture
from zen_mla.wire import regions_json


@server_fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Small limits, so that attacks fill them quickly: 4 upload slots, a 1 s grace."""
    with serve(
        tmp_path_factory.mktemp("door"),
        workers=1,
        max_uploads=4,
        body_grace_s=1.0,
        max_body_bytes=256 * MIB,
        max_inflight_bytes=256 * MIB,
        system_shm=True,
        max_seqs=1024,
    ) as s:
        yield s


def _during(
    attack: Callable[[threading.Event], None], server: Server, settle_s: float
) -> Latencies:
    """Four legitimate /prefill requests, 0.5 s apart, while `attack` runs (attacks.during)."""
    return during(
        attack, server, lambda: legitimate(server), settle_s=settle_s, rounds=4, pause_s=0.5
    )


def refusal(raw: bytes, code: int) -> str:
    """The message of a refusal in either form: problem+json (/prefill) or {"error"} (/v2)."""
    if b"application/problem+json" in raw.partition(b"\r\n\r\n")[0].lower():
        return str(assert_problem(raw, code)["detail"])
    assert raw.startswith(f"HTTP/1.1 {code} ".encode()), raw[:300]
    return str(json.loads(raw.partition(b"\r\n\r\n")[2])["error"])


# -- 1, 5: every media type's body through the one reader --------------------------------------


def regions_head(n: int) -> bytes:
    return (
        b"POST /prefill HTTP/1.1\r\nHost: x\r\n"
        + f"Content-Type: {regions_json.MEDIA_TYPE}\r\nContent-Length: {n}\r\n\r\n".encode()
    )


def register_head(n: int) -> bytes:
    return (
        b"POST /v2/systemsharedmemory/region/r/register HTTP/1.1\r\nHost: x\r\n"
        + f"Content-Type: application/json\r\nContent-Length: {n}\r\n\r\n".encode()
    )


@pytest.mark.parametrize("head", [regions_head, register_head], ids=["regions", "register"])
def test_a_silent_body_of_any_media_type_is_cut_off_with_408(door, head):
    """Defects 1 and 5: a regions JSON or a registration body that never comes held an upload
    slot (and /health) forever; now it is cut off as any slow body is."""
    with socket.create_connection(address(door), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(head(1000))
        answer = read_answer(s, 10)
        lived = time.monotonic() - t0
    assert "bytes/s" in refusal(answer, 408)
    assert lived < 5, lived


@pytest.mark.parametrize("head", [regions_head, register_head], ids=["regions", "register"])
def test_silent_bodies_do_not_lock_others_out(door, head):
    waits = _during(lambda stop: silent_heads(door, head(1000), 32, stop), door, 1.5)
    assert max(waits.seconds) < LOCKOUT_S, waits
    wait_for(lambda: door.health()["uploads"] == 0, 10, "the silent uploads cut off")


# -- 4: bytes announced, or sent just above the minimum rate ---------------------------------


def test_announced_gigabytes_sent_slowly_do_not_starve_the_budget(door):
    """Two uploads announcing 128 MiB each against a 256 MiB budget, sent at 1.1 MB/s: the
    budget holds what came (a window ahead of it), not what was announced, so others are
    served."""
    waits = _during(lambda stop: trickle(door, 128 * MIB, 2, 1.1e6, stop), door, 1.5)
    assert max(waits.seconds) < LOCKOUT_S, waits


def test_upload_slots_taken_by_uploads_just_above_the_minimum_rate_leave_others_a_share(door):
    """Uploads just above the minimum rate on every upload slot (4 here, 32 by default):
    another client takes a slot within its share, and the uploads keeping up with the
    advertised minimum are never cut off for it."""
    before = requests_counted(door, ("prefill",), 408)
    waits = _during(lambda stop: trickle(door, 64 * MIB, 4, 1.1e6, stop), door, 2.0)
    assert max(waits.seconds) < LOCKOUT_S, waits
    assert requests_counted(door, ("prefill",), 408) == before


# -- 2: counts a client controls ----------------------------------------------------------------


def test_too_many_sequences_is_a_422_naming_the_cap_before_any_work(door):
    """200,000 empty sequences in one valid request: the sequence count is capped (max_seqs)
    before anything is read per sequence, so the event loop never blocks on them."""
    t = good_tensors()
    n = 200_000
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[-1] = t["q"].shape[0]
    body = body_of(t | {"q_cu_seq_lens": cu})
    with door.client() as c:
        t0 = time.monotonic()
        r = c.post("/prefill", content=body, headers=OCTET)
        took = time.monotonic() - t0
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["tensor"] == "q_cu_seq_lens" and "1024 sequences" in problem["expected"]
    assert problem["hint"] == "Split the batch into smaller requests"
    assert took < 2, took


def test_health_answers_within_100_ms_during_a_request_at_the_sequence_cap(door):
    """The largest request the cap allows (1024 one-token sequences here) does its per-sequence
    work vectorised or off the event loop: /health stays prompt meanwhile."""
    n = 1024
    q = torch.randn(n, 4, 64).bfloat16()
    body = body_of({"q": q, "k": q, "v": q, "q_cu_seq_lens": torch.arange(n + 1)})
    done = threading.Event()
    slowest = [0.0]

    def poll() -> None:
        with httpx.Client(base_url=door.url) as c:
            while not done.is_set():
                t0 = time.monotonic()
                c.get("/health/live")
                slowest[0] = max(slowest[0], time.monotonic() - t0)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(3):
            with door.client() as c:
                assert c.post("/prefill", content=body, headers=OCTET).status_code == 200
    finally:
        done.set()
        poller.join(10)
    assert slowest[0] < 0.1, f"/health/live took {slowest[0] * 1e3:.0f} ms"


# -- 7: the connection cap ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_flood_of_idle_connections_does_not_keep_clients_out(tmp_path):
    """One process holding more idle sockets than the cap, reopening them as they close: at
    the cap a new connection takes the place of the one idle longest, so legitimate clients
    get in."""
    cap = 16
    with serve(tmp_path, workers=1, max_connections=cap) as server:

        def flood(stop: threading.Event) -> None:
            socks: list[socket.socket] = []
            try:
                while not stop.is_set():
                    socks = [s for s in socks if s.fileno() >= 0]
                    for s in list(socks):
                        s.setblocking(False)
                        try:
                            if s.recv(4096, socket.MSG_PEEK) is not None:
                                s.close()  # answered or closed: reopen
                        except BlockingIOError:
                            pass
                        except OSError:
                            s.close()
                    socks = [s for s in socks if s.fileno() >= 0]
                    while len(socks) < cap + 8:
                        try:
                            socks.append(socket.create_connection(address(server), timeout=2))
                        except OSError:
                            break
                    stop.wait(0.02)
            finally:
                for s in socks:
                    s.close()

        stop = threading.Event()
        t = threading.Thread(target=flood, args=(stop,), daemon=True)
        t.start()
        try:
            time.sleep(1.0)
            served, waits = 0, []
            for _ in range(20):
                t0 = time.monotonic()
                with httpx.Client(timeout=LOCKOUT_S) as c:
                    r = c.get(server.url + "/health/live")
                waits.append(time.monotonic() - t0)
                served += r.status_code == 200
        finally:
            stop.set()
            t.join(10)
        print(f"\nconnection flood: {served}/20 served, slowest {max(waits) * 1e3:.0f} ms")
        assert served == 20


@pytest.mark.slow
def test_at_the_cap_connections_with_a_request_in_flight_are_kept(tmp_path):
    """The connections a new one may displace are those without a request in flight: with
    every connection uploading, the next is refused (503), not anyone's request."""
    cap = 4
    with serve(tmp_path, workers=1, max_connections=cap, body_grace_s=5.0) as server:
        held = [socket.create_connection(address(server), timeout=10) for _ in range(cap)]
        try:
            for s in held:
                s.sendall(prefill_head(8 * MIB) + bytes(1000))
            time.sleep(0.3)
            with socket.create_connection(address(server), timeout=10) as extra:
                extra.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                assert "connections" in assert_problem(read_answer(extra, 5), 503)["detail"]
        finally:
            for s in held:
                s.close()


# -- 8: hang-ups -----------------------------------------------------------------------------


@pytest.mark.slow
def test_hanging_up_on_running_work_restarts_no_worker(tmp_path):
    """A heavy request hung up 0.3 s in, over and over: started work runs to its end (its
    queue place held meanwhile), work not started is dropped, and no worker restarts, so a
    legitimate request waits no longer than behind the work."""
    with serve(tmp_path, workers=1) as server:
        body = body_of(slow_tensors(3000), {"kernel": "reference", "causal": "false"})
        baseline = legitimate(server)
        for _ in range(4):
            with socket.create_connection(address(server), timeout=10) as s:
                s.sendall(prefill_head(len(body)) + body)
                time.sleep(0.3)
        waits = [legitimate(server) for _ in range(3)]
        print(
            f"\nhang-ups: baseline {baseline * 1e3:.0f} ms, after", [round(w * 1e3) for w in waits]
        )
        workers = server.health()["workers"]
        assert [w["restarts"] for w in workers] == [0], workers
        # the heavy work (~0.4 s each on 2 cores) may still be running: never a restart
        assert max(waits) < baseline + 10, (baseline, waits)
        wait_for(lambda: server.health()["inflight"] == 0, 30, "the abandoned work ended")


# -- 13, 14, 16, 17: the v2 request's counts and encodings --------------------------------


def v2_json(inputs: list[dict], **extra: object) -> dict:
    return {"inputs": inputs, **extra}


def tensor(name: str, datatype: str, shape: list[int], data: list) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


INFER = "/v2/models/mla_prefill/infer"


@pytest.mark.parametrize(
    "value", [b"\xb2", b"9" * 5000, b"1" * 19], ids=["superscript-2", "5000-digits", "19-digits"]
)
def test_inference_header_length_that_is_not_a_byte_count_is_400(door, value):
    """Latin-1 superscript digits or 5,000 digits in a byte count: a 400, not a 500."""
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": value}
    with door.client() as c:
        r = c.post(INFER, content=b"{}", headers=headers)
    assert r.status_code == 400, r.text
    assert "Inference-Header-Content-Length" in r.json()["error"]


@pytest.mark.parametrize("dims", [(1 << 63, 4), (1 << 64, 4), (1 << 48, 4), (1 << 47, 1 << 47)])
def test_a_dimension_of_2_to_the_63_is_a_422(door, dims):
    """And dims each under the cap whose elements are not (a 0 dim counted as 1): torch's view
    of no elements overflowed on them, a 500."""
    dim, d = dims
    doc = v2_json(
        [
            tensor("q", "FP32", [0, dim, d], []),
            tensor("k", "FP32", [0, dim, d], []),
            tensor("v", "FP32", [0, dim, d], []),
            tensor("q_cu_seq_lens", "INT32", [1], [0]),
        ]
    )
    with door.client() as c:
        r = c.post(INFER, json=doc)
    assert r.status_code == 422, r.text
    assert "shape" in r.json()["error"]


def test_json_outputs_never_carry_infinities(door):
    """The LSE of a query that sees no key is -inf, which JSON cannot carry: a 422 asking for
    binary output (never `-Infinity` in JSON), and binary works."""
    q = [[[1.0, 0.0]], [[0.0, 1.0]]]  # [2, 1, 2]
    inputs = [
        tensor("q", "FP32", [2, 1, 2], q),
        tensor("k", "FP32", [0, 1, 2], []),
        tensor("v", "FP32", [0, 1, 2], []),
        tensor("q_cu_seq_lens", "INT32", [2], [0, 2]),
        tensor("kv_cu_seq_lens", "INT32", [2], [0, 0]),
    ]
    with door.client() as c:
        r = c.post(INFER, json=v2_json(inputs, parameters={"return_lse": True}))
        assert r.status_code == 422, r.text
        assert "binary" in r.json()["error"]  # valid JSON, saying what to do
        out_only = c.post(INFER, json=v2_json(inputs))
        assert out_only.status_code == 200, out_only.text
        answer = json.loads(out_only.text)  # strict JSON
        assert answer["outputs"][0]["data"] == [0.0] * 4


def test_a_v2_request_id_is_capped_as_prefill_caps_it(door):
    """An 8 MiB `id`: refused (ids are at most 128 characters), never echoed or logged."""
    t = good_tensors()
    doc = v2_json(
        [
            tensor("q", "FP32", [1, 1, 2], [[[1.0, 2.0]]]),
            tensor("k", "FP32", [1, 1, 2], [[[1.0, 2.0]]]),
            tensor("v", "FP32", [1, 1, 2], [[[1.0, 2.0]]]),
            tensor("q_cu_seq_lens", "INT32", [2], [0, 1]),
        ],
        id="x" * (1 << 20),
    )
    del t
    with door.client() as c:
        r = c.post(INFER, json=doc)
    assert r.status_code == 422, r.text[:300]
    # refused on the head's bytes (a string past 4096 bytes), before the id's own rule (<= 128)
    assert len(r.text) < 1000 and r.json()["error"].startswith("id: expected a string of at most")
    log = door.logs()
    assert "x" * 1000 not in log


# -- 22: lingering ------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_early_413_reaches_a_client_that_sends_everything_before_reading(tmp_path):
    """With the body limit lowered to 1 MiB, a client that writes its whole 32 MiB body before
    reading (http.client, as many simple clients) reads its 413, not a broken pipe: the
    service lingers by time, with a byte cap of its own, not by the body limit."""
    with serve(tmp_path, workers=1, max_body_bytes=MIB) as server:
        host, port = address(server)
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("POST", "/prefill", body=bytes(32 * MIB), headers=OCTET)
        r = conn.getresponse()
        assert r.status == 413
        assert json.loads(r.read())["status"] == 413
        conn.close()
