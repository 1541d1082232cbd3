"""The gRPC surface under the attacks the HTTP one is tested with, on real servers: a message
sent slowly, a call that never sends one, connections that say nothing or nothing more, a
message announced larger than the limit, an answer left unread, a bad token, and a flood from
one tenant while another is served within its share. Slow and idle callers are written frame
by frame with `h2` (no gRPC client sends slowly or leaves an answer unread); each test prints
what it measured."""

from __future__ import annotations

import os
import select
import socket
import statistics
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events
import pytest
import torch
from tritonclient.grpc import InferenceServerClient, InferenceServerException
from tritonclient.grpc import service_pb2 as pb

from bench._server import free_port
from tests.batches import BatchSpec, make_batch
from tests.service.grpc_caller import grpc_inputs
from tests.service.servers import Server, serve, server_fixture
from tests.service.v2_tensors import to_torch
from zen_mla import ragged_attention

pytestmark = pytest.mark.slow

INFER = "/inference.GRPCInferenceService/ModelInfer"
DEADLINE_S = 4.0
HEAD_S = 2.0
DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED = 4, 8


@server_fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("grpc_attacks")
    tenants = tmp / "tenants"
    tenants.write_text("flood fl00d-token\nquiet qu1et-token\n")
    with serve(
        tmp,
        grpc_port=free_port(),
        workers=min(2, len(os.sched_getaffinity(0))),
        deadline_s=DEADLINE_S,
        header_timeout_s=HEAD_S,
        body_grace_s=0.5,
        max_uploads=2,
        max_queue=4,
        max_body_bytes=32 << 20,
        tenants_file=tenants,
    ) as s:
        yield s


QUIET = {"authorization": "Bearer qu1et-token"}
FLOOD = {"authorization": "Bearer fl00d-token"}


def _batch(lens=(64, 32)):
    return make_batch(BatchSpec(list(lens)), (2, 192, 128), torch.bfloat16)


def _served(server: Server, headers=QUIET) -> float:
    """One good call's seconds (its answer checked against the library's)."""
    q, k, v, q_cu, _ = _batch()
    named = {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}
    with InferenceServerClient(server.grpc_target) as c:
        t = time.monotonic()
        result = c.infer("mla_prefill", grpc_inputs(named), headers=headers)
        took = time.monotonic() - t
    assert torch.equal(to_torch(result.as_numpy("out")), ragged_attention(q, k, v, q_cu))
    return took


@dataclass
class Ending:
    status: int | None  # grpc-status, None where the stream or connection ended without one
    message: str
    seconds: float


def _raw_call(
    server: Server,
    chunks: list[bytes],
    every: float,
    headers=QUIET,
    close: bool = True,
    hang_up_after: float = 30,
) -> Ending:
    """A ModelInfer call written frame by frame: `chunks` of its body one per `every`
    seconds (the last closes the stream where `close`), reading the server's frames meanwhile."""
    sock = socket.create_connection(("127.0.0.1", server.grpc_port or 0), timeout=30)
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(
        sid,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", INFER),
            (":authority", server.grpc_target),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *headers.items(),
        ],
        end_stream=close and not chunks,
    )
    sock.sendall(conn.data_to_send())
    start = time.monotonic()
    got: dict[str, str] = {}
    pending = list(chunks)
    next_at = start
    try:
        while time.monotonic() - start < hang_up_after:
            window = conn.local_flow_control_window(sid) if pending else 0
            if pending and time.monotonic() >= next_at and len(pending[0]) <= window:
                conn.send_data(sid, pending.pop(0), end_stream=close and not pending)
                sock.sendall(conn.data_to_send())
                next_at += every
            wait = max(0.0, next_at - time.monotonic()) if pending else 1.0
            if pending and len(pending[0]) > window:
                wait = 0.05  # for the server to open the window
            if not select.select([sock], [], [], wait)[0]:
                continue
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    got |= dict(event.headers)
                if isinstance(
                    event,
                    h2.events.StreamEnded | h2.events.StreamReset | h2.events.ConnectionTerminated,
                ):
                    status = got.get("grpc-status")
                    return Ending(
                        None if status is None else int(status),
                        got.get("grpc-message", ""),
                        time.monotonic() - start,
                    )
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()
    return Ending(None, "no end", time.monotonic() - start)


def _framed(payload: bytes) -> bytes:
    return b"\0" + struct.pack(">I", len(payload)) + payload


def test_a_slow_message_ends_at_the_deadline_and_others_are_served(server):
    body = _framed(b"\x0a\x0bmla_prefill" + b"\0" * 60_000)
    chunks = [body[i : i + 1024] for i in range(0, len(body), 1024)]
    ending: list[Ending] = []
    slow = threading.Thread(target=lambda: ending.append(_raw_call(server, chunks, 0.25)))
    slow.start()
    time.sleep(0.5)
    others = [_served(server) for _ in range(5)]
    slow.join(30)
    (end,) = ending
    print(
        f"slow message: status {end.status} after {end.seconds:.2f} s ({end.message!r}); "
        f"others served in {statistics.median(others) * 1e3:.1f} ms (median of 5)"
    )
    assert end.status == DEADLINE_EXCEEDED and "did not arrive within" in end.message
    assert DEADLINE_S - 0.5 < end.seconds < DEADLINE_S + 3


def test_a_call_that_never_sends_its_message_ends_at_the_deadline(server):
    end = _raw_call(server, [b"\0\0\0"], 100.0, close=False)  # 3 of 5 prefix bytes, then none
    print(f"idle call: status {end.status} after {end.seconds:.2f} s")
    assert end.status == DEADLINE_EXCEEDED
    assert end.seconds < DEADLINE_S + 3


def test_slow_uploads_past_their_grace_are_cut_off_for_newcomers(server):
    """Both upload slots (max_uploads 2) held by silent calls: past the grace, a newcomer's
    call takes the slot of one of them, answered then, not at the deadline."""
    endings: list[Ending] = []
    silent = [
        threading.Thread(
            target=lambda: endings.append(_raw_call(server, [b"\0"], 100.0, close=False))
        )
        for _ in range(2)
    ]
    for t in silent:
        t.start()
    time.sleep(1.0)  # past the 0.5 s grace
    took = _served(server)
    for t in silent:
        t.join(30)
    cut = [e for e in endings if "cut off for another" in e.message]
    print(
        f"newcomer served in {took * 1e3:.1f} ms; silent calls: "
        f"{[(e.status, round(e.seconds, 2)) for e in endings]}"
    )
    assert cut and all(e.status == DEADLINE_EXCEEDED for e in cut)
    assert min(e.seconds for e in cut) < DEADLINE_S - 1


def test_a_message_announced_over_the_limit_is_refused_unread(server):
    prefix = b"\0" + struct.pack(">I", 64 << 20)  # 64 MiB announced, limit 32 MiB, none sent
    end = _raw_call(server, [prefix], 100.0, close=False)
    print(f"64 MiB announced: status {end.status} after {end.seconds * 1e3:.1f} ms")
    assert end.status == RESOURCE_EXHAUSTED and end.seconds < 2


def _closed_after(sock: socket.socket) -> float:
    start = time.monotonic()
    sock.settimeout(30)
    while True:
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except ConnectionResetError:
            return time.monotonic() - start


def test_connections_that_say_nothing_are_closed(server):
    with socket.create_connection(("127.0.0.1", server.grpc_port or 0)) as silent:
        took_silent = _closed_after(silent)
    with socket.create_connection(("127.0.0.1", server.grpc_port or 0)) as idle:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        idle.sendall(conn.data_to_send())
        took_idle = _closed_after(idle)
    print(f"silent connection closed after {took_silent:.2f} s, idle one after {took_idle:.2f} s")
    assert HEAD_S - 0.5 < took_silent < HEAD_S + 3
    assert took_idle < HEAD_S * 2 + 3


def test_a_call_closed_without_a_message_is_invalid(server):
    end = _raw_call(server, [b"\0\0\0"], 0.0)  # 3 of 5 prefix bytes, then the stream's end
    assert end.status == 3 and "one request message" in end.message, end


def test_a_bad_token_is_unauthenticated(server):
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic qu1et-token"}):
        end = _raw_call(server, [_framed(b"")], 0.0, headers=headers)
        assert end.status == 16 and "bearer token" in end.message, end


def test_a_flood_from_one_tenant_leaves_the_other_its_share(server):
    """`flood` keeps 12 calls going for 6 s against a queue of 4; `quiet` calls one at a time
    meanwhile: every quiet call is answered (a flood's excess is refused, not the quiet
    tenant's share)."""
    stop = time.monotonic() + 6
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    q, k, v, q_cu, _ = _batch((512, 512))
    named = {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}

    def flood() -> None:
        with InferenceServerClient(server.grpc_target) as c:
            inputs = grpc_inputs(named)
            while time.monotonic() < stop:
                try:
                    c.infer("mla_prefill", inputs, headers=FLOOD)
                    kind = "ok"
                except InferenceServerException as exc:
                    kind = str(exc.status())
                with lock:
                    outcomes[kind] += 1

    threads = [threading.Thread(target=flood) for _ in range(12)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    quiet = []
    while time.monotonic() < stop - 0.5:
        quiet.append(_served(server))
    for t in threads:
        t.join(60)
    print(
        f"flood: {dict(outcomes)}; quiet: {len(quiet)} calls, all answered, median "
        f"{statistics.median(quiet) * 1e3:.0f} ms, slowest {max(quiet) * 1e3:.0f} ms; alone "
        f"{_served(server) * 1e3:.0f} ms"
    )
    assert quiet and outcomes["StatusCode.RESOURCE_EXHAUSTED"] > 0


def test_an_unread_answer_stays_charged_to_its_caller_until_the_call_ends(server):
    """A call whose caller never opens its window past HTTP/2's first 64 KiB: its 1 MiB answer
    stays charged to it while grpc holds it unread, and is given back once the caller goes."""
    q, k, v, q_cu, _ = _batch((2048,))
    request = pb.ModelInferRequest(model_name="mla_prefill")
    for name, t in {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}.items():
        bf16 = t.dtype == torch.bfloat16
        request.inputs.add(name=name, datatype="BF16" if bf16 else "INT32", shape=list(t.shape))
        request.raw_input_contents.append((t.view(torch.int16) if bf16 else t).numpy().tobytes())
    body = _framed(request.SerializeToString())
    chunks = [body[i : i + 16384] for i in range(0, len(body), 16384)]
    ending: list[Ending] = []
    call = threading.Thread(
        target=lambda: ending.append(_raw_call(server, chunks, 0, hang_up_after=4.0))
    )
    call.start()
    time.sleep(3.0)
    held = server.health()["held_bytes"]["answer"]
    call.join(30)
    time.sleep(0.5)
    after = server.health()["held_bytes"]["answer"]
    print(f"unread answer: {held} bytes charged while unread; {after} once the caller hung up")
    assert held >= 1 << 20 and after == 0
    assert ending[0].status is None  # no answer while unread


def test_a_caller_that_gives_up_mid_work_costs_no_worker(server):
    """tritonclient.grpc's own deadline passing while the work runs: the call ends (499 in the
    metrics), its work runs out as an HTTP hang-up's does, no worker is replaced, and the next
    call is answered right."""
    q, k, v, q_cu, _ = _batch((8000,))  # about a second of the reference kernel's work
    named = {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}
    before = [w["restarts"] for w in server.health()["workers"]]
    with (
        InferenceServerClient(server.grpc_target) as c,
        pytest.raises(InferenceServerException) as info,
    ):
        c.infer(
            "mla_prefill",
            grpc_inputs(named),
            parameters={"causal": False, "kernel": "reference"},
            headers=QUIET,
            client_timeout=0.3,
        )
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    time.sleep(2)
    with server.client() as http:
        metrics = http.get("/metrics").text
    took = _served(server)
    print(f"caller gave up at 0.3 s; the next call answered in {took * 1e3:.1f} ms")
    assert 'zen_mla_requests_total{route="grpc",status="499"}' in metrics
    assert [w["restarts"] for w in server.health()["workers"]] == before
