"""Prefill calls on the region socket (no HTTP on their way) against real servers: results equal
the fp64 reference through both clients, every error class arrives as the class it left as,
and the socket's rules hold for calls (hang-up, frame deadline, one call per connection)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import zen_mla
from tests.batches import BATCH_SPECS, make_batch
from tests.processes import eventually, wait_for
from tests.reference import assert_close_to_reference
from tests.service.region_clients import lay_out, region_socket
from tests.service.restart import requests_answered, requests_counted
from tests.service.servers import (
    Server,
    busy_worker,
    serve,
    server_fixture,
    wait_draining,
    wait_ready,
)
from zen_mla.client import AsyncPrefillClient, PrefillClient
from zen_mla.regions.connection import ClientRegion, RegionConnection, RegionSet
from zen_mla.regions.protocol import recv_frame, send_frame
from zen_mla.wire import regions_json as rr

pytestmark = pytest.mark.slow
SPECS = ("ragged", "prefix_cached", "context_chunk", "more_queries_than_keys")


def socket_calls(server: Server, status: int = 200) -> int:
    """How many calls the server answered on the region socket with `status` (its metrics)."""
    return requests_counted(server, ("socket",), status)


def long_batch(tokens: int = 12288) -> tuple[torch.Tensor, ...]:
    """One causal request that takes a worker seconds here."""
    q, k, v = (torch.randn(tokens, 16, d, dtype=torch.bfloat16) for d in (192, 192, 128))
    return q, k, v, torch.tensor([0, tokens])


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
def test_sync_calls_equal_the_reference(server, return_lse):
    before = socket_calls(server)
    with PrefillClient(server.url, shared_memory=True) as client:
        regions = client.regions(0)
        assert regions is not None and regions.connection.calls  # the hello offers calls
        for name in SPECS:
            q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS[name], (3, 192, 128), torch.bfloat16)
            causal = BATCH_SPECS[name].kv_lens is None
            got = client.prefill(q, k, v, q_cu, kv_cu, causal=causal, return_lse=return_lse)
            out, lse = got if return_lse else (got, None)
            assert_close_to_reference(q, k, v, q_cu, kv_cu, causal, out, lse)
    # every one went over the socket
    assert requests_answered(server, before + len(SPECS), ("socket",)) - before == len(SPECS)


def test_async_calls_equal_the_reference(server):
    before = socket_calls(server)

    async def main():
        got = []
        async with AsyncPrefillClient(server.url) as client:  # shared_memory=None: automatic
            for name in SPECS:
                q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS[name], (2, 192, 128), torch.float32)
                got.append((q, k, v, q_cu, kv_cu, await client.prefill(
                    q, k, v, q_cu, kv_cu, causal=False, return_lse=True
                )))  # fmt: skip
        return got

    for q, k, v, q_cu, kv_cu, (out, lse) in asyncio.run(main()):
        assert_close_to_reference(q, k, v, q_cu, kv_cu, False, out, lse)
    assert requests_answered(server, before + len(SPECS), ("socket",)) - before == len(SPECS)


def test_a_422_names_the_tensor_with_its_hint(tmp_path):
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["equal_runs"], (2, 64, 64), torch.float32)
    with (
        serve(tmp_path, workers=1, max_seqs=4) as s,
        PrefillClient(s.url, shared_memory=True) as client,
    ):
        with pytest.raises(zen_mla.InvalidInputError) as caught:
            client.prefill(q, k, v, q_cu)
        assert caught.value.name == "q_cu_seq_lens" and "4 sequences" in caught.value.expected
        assert caught.value.hint == "Split the batch into smaller requests"
        assert socket_calls(s, 422) == 1
        small = make_batch(BATCH_SPECS["single"], (2, 64, 64), torch.float32)
        assert_close_to_reference(*small, True, client.prefill(*small))  # the socket lives on


@server_fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One worker, one queue place, a 1.5 s deadline."""
    with serve(tmp_path_factory.mktemp("tight"), workers=1, max_queue=1, deadline_s=1.5) as s:
        yield s


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def queue_depth(server: Server) -> int:
    with server.client() as c:
        text = c.get("/metrics").text
    return int(next(x for x in text.splitlines() if x.startswith("zen_mla_queue_depth "))[20:])


def _long_call(server: Server, tokens: int = 12288) -> threading.Thread:
    """A long request from another client, queued or running when this returns."""

    def run() -> None:
        # its deadline may cut it
        with PrefillClient(server.url, retries=0) as c, contextlib.suppress(zen_mla.ZenMLAError):
            c.prefill(*long_batch(tokens))

    t = _in_thread(run)
    wait_for(lambda: queue_depth(server) >= 1, 20, "the long request never queued", 0.02)
    return t


def _hold_worker(server: Server) -> None:
    """Stop the worker (SIGSTOP): whatever it is given next outlasts any deadline, on any host,
    until the service abandons it and replaces the worker."""
    wait_ready(server)
    os.kill(server.health()["workers"][0]["pid"], signal.SIGSTOP)


def test_429_with_retry_after_and_504_past_the_deadline(tight):
    small = make_batch(BATCH_SPECS["single"], (2, 64, 64), torch.float32)
    with PrefillClient(tight.url, shared_memory=True, retries=0) as client:
        client.prefill(*small)  # connected and greeted before the queue fills
        _hold_worker(tight)
        busy = _long_call(tight, 64)  # the one queue place, held by the stopped worker
        with pytest.raises(zen_mla.QueueFullError) as full:
            client.prefill(*small)
        assert full.value.retry_after == 1
        busy.join(30)  # cut at its deadline, its worker replaced
        _hold_worker(tight)
        with pytest.raises(zen_mla.DeadlineExceededError, match="deadline"):
            client.prefill(*small)
        wait_ready(tight)
        assert_close_to_reference(*small, True, client.prefill(*small))
    # the other client's call went over its own socket, and was cut at the deadline too
    assert socket_calls(tight, 429) == 1 and socket_calls(tight, 504) == 2


def test_a_retried_429_is_answered_once_there_is_room(tight):
    small = make_batch(BATCH_SPECS["single"], (2, 64, 64), torch.float32)
    with PrefillClient(tight.url, shared_memory=True, retries=5, timeout=30) as client:
        client.prefill(*small)
        before = socket_calls(tight, 429)
        _hold_worker(tight)
        pid = tight.health()["workers"][0]["pid"]
        busy = _long_call(tight, 64)  # the one place, held until the worker goes on

        def go_on_once_refused() -> None:
            eventually(lambda: socket_calls(tight, 429) != before, 20, 0.02)
            os.kill(pid, signal.SIGCONT)  # the held call ends: there is room

        resume = _in_thread(go_on_once_refused)
        assert_close_to_reference(*small, True, client.prefill(*small))
        resume.join(30)
        busy.join(30)
    assert socket_calls(tight, 429) > before  # refused first, retried after Retry-After


def test_503_while_draining(tmp_path):
    small = make_batch(BATCH_SPECS["single"], (2, 64, 64), torch.float32)
    with (
        serve(tmp_path, workers=1, deadline_s=3) as s,
        PrefillClient(s.url, shared_memory=True, retries=0) as client,
    ):
        client.prefill(*small)
        busy = _long_call(s)  # holds the drain open while it runs
        s.process.send_signal(signal.SIGTERM)
        wait_draining(s)
        with pytest.raises(zen_mla.ServiceUnavailableError, match="draining") as caught:
            client.prefill(*small)
        assert caught.value.retry_after == 5
        busy.join(30)


# -- the socket's rules, for calls ---------------------------------------------------------------


def _call_frame(places: dict, meta: dict | None = None) -> dict:
    return {"op": "prefill", "body": rr.encode(places, meta).decode()}


def test_a_client_gone_mid_call_leaves_the_service_healthy(tight):
    """Its socket closes while the call runs: the started work runs on holding its queue place
    (until it ends or its deadline stops it), the call is a 499, the service answers others."""
    wait_ready(tight)
    before = socket_calls(tight, 499)
    client = RegionConnection(region_socket(tight), None)
    q, k, v, cu = long_batch()
    with RegionSet(client).request({"q": q, "k": k, "v": v, "q_cu_seq_lens": cu}, False) as at:
        send_frame(client._sock, _call_frame(at.places))
        # held mid-work, so that it still runs when the hang-up is seen, however fast the host
        os.kill(busy_worker(tight, 30)["pid"], signal.SIGSTOP)
        client.close()  # its work has started: it runs on, holding its place
    deadline = time.monotonic() + 30
    wait_for(
        lambda: socket_calls(tight, 499) - before >= 1, 30, "the hang-up was not counted", 0.02
    )
    assert queue_depth(tight) == 1  # the started work holds its place
    wait_for(
        lambda: not queue_depth(tight),
        deadline - time.monotonic(),
        "its place was not freed at its deadline",
        0.1,
    )
    wait_ready(tight)
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 64), torch.float32)
    with PrefillClient(tight.url, shared_memory=True) as c:
        assert_close_to_reference(q, k, v, q_cu, None, True, c.prefill(q, k, v, q_cu))


def test_a_client_that_hangs_up_once_its_worker_answered_is_counted_answered(server):
    """A call its worker answers reaches the client before the service reads the worker's
    Done; a client that closes its socket at once has had its answer: a 200, never a 499
    (the last call of a `with PrefillClient(...)` block was counted a hang-up)."""
    clients = 30
    hung_up, answered = socket_calls(server, 499), socket_calls(server)
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 64), torch.float32)
    for _ in range(clients):
        with PrefillClient(server.url, shared_memory=True) as c:
            assert_close_to_reference(q, k, v, q_cu, None, True, c.prefill(q, k, v, q_cu))
    assert requests_answered(server, answered + clients, ("socket",)) - answered == clients
    assert socket_calls(server, 499) == hung_up


def test_a_second_frame_waits_for_the_first_calls_reply(server):
    """One call per connection: a hello sent right behind a long call is answered after it
    (read at once, it would have been answered first)."""
    client = RegionConnection(region_socket(server), None)
    try:
        region = ClientRegion(client, 64 << 20)
        places, (q, k, v, cu, out) = lay_out(region, 2048, lse=False)
        send_frame(client._sock, _call_frame(places, {"request_id": "first"}))
        send_frame(client._sock, {"op": "hello", "token": ""})
        first = recv_frame(client._sock, time.monotonic() + 60)
        second = recv_frame(client._sock, time.monotonic() + 60)
        assert first["ok"] and json.loads(first["body"])["__metadata__"]["request_id"] == "first"
        assert "max_regions" in second and second["calls"] is True
        assert_close_to_reference(q, k, v, cu, None, True, out)
    finally:
        client.close()


def _logged(server: Server, request_id: str) -> list[dict]:
    lines = [
        json.loads(x) for x in server.logs().splitlines() if x.startswith('{"event": "socket"')
    ]
    return [x for x in lines if x.get("request_id") == request_id]


def test_a_numbered_call_is_answered_by_its_worker_with_its_number(server):
    """A frame with its call number is answered by the worker that ran it (the log line says
    so), numbered; one without is answered by the service, unnumbered; results the same."""
    client = RegionConnection(region_socket(server), None)
    try:
        region = ClientRegion(client, 64 << 20)
        places, (q, k, v, cu, out) = lay_out(region, 64, lse=False)
        for call, request_id in ((1, "numbered"), (2**53 - 1, "numbered"), (None, "plain")):
            out.zero_()
            frame = _call_frame(places, {"request_id": request_id})
            send_frame(client._sock, frame if call is None else frame | {"call": call})
            reply = recv_frame(client._sock, time.monotonic() + 60)
            assert reply["ok"] and reply.get("call") == call, reply
            assert_close_to_reference(q, k, v, cu, None, True, out)
        wait_for(
            lambda: len(_logged(server, "numbered")) >= 2 and _logged(server, "plain"),
            10,
            "no log lines for the calls",
        )
        assert [x["replied_by"] for x in _logged(server, "numbered")] == ["worker", "worker"]
        assert [x["replied_by"] for x in _logged(server, "plain")] == ["service"]
    finally:
        client.close()


@pytest.mark.parametrize("call", ["7", -1, True, 2**53, 1.5, None])
def test_a_call_number_that_is_not_a_whole_number_is_refused_naming_it(server, call):
    client = RegionConnection(region_socket(server), None)
    try:
        region = ClientRegion(client, 1 << 20)
        places, _ = lay_out(region, 4, lse=False)
        send_frame(client._sock, _call_frame(places) | {"call": call})
        reply = recv_frame(client._sock, time.monotonic() + 60)
        if call is None:  # null: no number, as with none
            assert reply["ok"] and "call" not in reply
            return
        assert reply["status"] == 422 and reply["tensor"] == "call", reply
        assert "call" not in reply  # not a number to answer with
        assert repr(call)[:10] in reply["got"]
    finally:
        client.close()
    assert server.health()["status"] == "ok"


def test_a_half_sent_call_frame_is_cut_at_the_frame_deadline(tmp_path):
    with serve(tmp_path, workers=1, header_timeout_s=1) as s:
        client = RegionConnection(region_socket(s), None)
        try:
            sock = client._sock
            frame = json.dumps(_call_frame({})).encode()
            sock.sendall(struct.pack(">I", len(frame)) + frame[:10])
            t0 = time.monotonic()
            refusal = recv_frame(sock, t0 + 10)
            assert refusal["status"] == 408 and "not whole" in refusal["error"]
            assert time.monotonic() - t0 < 3
            sock.settimeout(5)
            assert sock.recv(1) == b""  # and the connection ends
        finally:
            client.close()
        with socket.socket(socket.AF_UNIX) as other:  # the socket still takes others
            other.connect(region_socket(s))
        assert s.health()["status"] == "ok"
