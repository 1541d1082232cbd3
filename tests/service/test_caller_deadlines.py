"""A call whose caller gives up at its own deadline while the call waits in the queue is never
computed, on every route: `/prefill` (PrefillClient over TCP), the region socket (PrefillClient
with same-host regions), KServe v2 over HTTP (tritonclient.http's network timeout) and over gRPC
(tritonclient.grpc's `client_timeout`, a gRPC deadline). And a caller that sends its deadline
(`zen_mla.deadline`: the `Zen-MLA-Timeout` header, a region call's `timeout` field, KServe v2's
`timeout` parameter) and waits on, its connection open, is answered 504 at that deadline, its
work not computed. On a real server with one worker, kept busy by another caller's long call so
that the call under test is queued: the queries the service counts as computed
(`zen_mla_tokens_total`) grow by the long call's alone, and a call after is answered right."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from bench._server import free_port
from tests.batches import BatchSpec, make_batch
from tests.processes import eventually
from tests.service.bodies import OCTET, body_of, slow_tensors
from tests.service.region_clients import lay_out, region_socket
from tests.service.servers import Server, busy_worker, serve, server_fixture
from tests.service.v2_tensors import to_numpy, to_torch
from zen_mla import DeadlineExceededError, ragged_attention
from zen_mla.client import PrefillClient
from zen_mla.deadline import HEADER
from zen_mla.regions.connection import ClientRegion, RegionConnection
from zen_mla.regions.protocol import call_fields, numbered
from zen_mla.wire import regions_json

#: the long call: ~3 s of the reference kernel on 2 cores, far longer than the caller's deadline
BUSY_TOKENS = 8000
#: the caller's deadline, well within the long call
DEADLINE_S = 0.5
#: the call under test: a count of queries no other call has
QUEUED = BatchSpec([37, 40])


@server_fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("deadlines"), workers=1, grpc_port=free_port()) as s:
        yield s


def _tensors() -> dict[str, torch.Tensor]:
    q, k, v, q_cu, _ = make_batch(QUEUED, (2, 192, 128), torch.bfloat16)
    return {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}


def _prefill(shared_memory: bool) -> Callable[[Server, dict[str, torch.Tensor], float], object]:
    def call(server: Server, t: dict[str, torch.Tensor], timeout: float) -> object:
        with PrefillClient(server.url, shared_memory=shared_memory, timeout=timeout) as c:
            return c.prefill(t["q"], t["k"], t["v"], t["q_cu_seq_lens"])

    return call


def _v2_inputs(kind, t: dict[str, torch.Tensor]) -> list:
    inputs = []
    for name, tensor in t.items():
        a = to_numpy(tensor)
        entry = kind.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        entry.set_data_from_numpy(a)
        inputs.append(entry)
    return inputs


def _v2_http(server: Server, t: dict[str, torch.Tensor], timeout: float) -> object:
    netloc = urlparse(server.url).netloc
    with triton_http.InferenceServerClient(netloc, network_timeout=timeout) as c:
        result = c.infer("mla_prefill", _v2_inputs(triton_http, t))
        return to_torch(result.as_numpy("out"))


def _v2_grpc(server: Server, t: dict[str, torch.Tensor], timeout: float) -> object:
    with triton_grpc.InferenceServerClient(server.grpc_target) as c:
        result = c.infer("mla_prefill", _v2_inputs(triton_grpc, t), client_timeout=timeout)
        return to_torch(result.as_numpy("out"))


#: each route's call, and what its client raises at its deadline (the v2 HTTP client's socket
#: times out; the gRPC deadline comes back as DEADLINE_EXCEEDED)
ROUTES = {
    "prefill": (_prefill(shared_memory=False), DeadlineExceededError),
    "region socket": (_prefill(shared_memory=True), DeadlineExceededError),
    "v2 http": (_v2_http, TimeoutError),
    "v2 grpc": (_v2_grpc, InferenceServerException),
}


def _queries(server: Server) -> int:
    with server.client() as c:
        text = c.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith('zen_mla_tokens_total{kind="q"}'))
    return int(float(line.split()[-1]))


@contextlib.contextmanager
def _worker_busy(server: Server) -> Iterator[dict[str, int]]:
    """The one worker busy with another caller's long call (~3 s) for the block's length; its
    status once it ends."""
    busy_body = body_of(slow_tensors(BUSY_TOKENS), {"kernel": "reference", "causal": "false"})
    busy: dict[str, int] = {}

    def keep_busy() -> None:
        with server.client() as c:
            busy["status"] = c.post("/prefill", content=busy_body, headers=OCTET).status_code

    thread = threading.Thread(target=keep_busy)
    thread.start()
    try:
        busy_worker(server)
        yield busy
    finally:
        thread.join(120)


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_a_queued_call_whose_caller_gave_up_is_not_computed(server, route):
    call, error = ROUTES[route]
    before = _queries(server)
    with _worker_busy(server) as busy:
        t0 = time.monotonic()
        with pytest.raises(error):
            call(server, _tensors(), DEADLINE_S)
        gave_up = time.monotonic() - t0
    assert busy["status"] == 200
    assert gave_up < DEADLINE_S + 2, gave_up
    # the long call's queries alone were computed, never the queued call's
    assert eventually(lambda: _queries(server) - before == BUSY_TOKENS, 10), (
        _queries(server) - before
    )
    t = _tensors()
    out = call(server, t, 60)
    assert torch.equal(out, ragged_attention(*t.values()))
    assert eventually(lambda: _queries(server) - before == BUSY_TOKENS + 77, 10)


def _sent_prefill(server: Server, t: dict[str, torch.Tensor]) -> int:
    """POST /prefill with `Zen-MLA-Timeout`, the client waiting two minutes: the status."""
    with server.client() as c:
        headers = OCTET | {HEADER: str(DEADLINE_S)}
        return c.post("/prefill", content=body_of(t), headers=headers).status_code


def _sent_region_call(server: Server, t: dict[str, torch.Tensor]) -> int:
    """A region call whose frame says `timeout`, its reply waited for a minute: its status."""
    connection = RegionConnection(region_socket(server), None, timeout=60)
    try:
        places, _ = lay_out(ClientRegion(connection, 1 << 20), 64, lse=False)
        fields = call_fields({"body": regions_json.encode(places).decode()})
        reply = connection._exchange(numbered(1, fields, DEADLINE_S), None, 60, 1)
        return 200 if reply["ok"] else int(reply["status"])
    finally:
        connection.close()


def _sent_v2(kind, target: str, t: dict[str, torch.Tensor]) -> int:
    """A v2 infer with the `timeout` parameter (microseconds), the client waiting a minute."""
    client = (
        kind.InferenceServerClient(target, network_timeout=60)
        if kind is triton_http
        else kind.InferenceServerClient(target)
    )
    with client as c:
        try:
            c.infer("mla_prefill", _v2_inputs(kind, t), timeout=int(DEADLINE_S * 1e6))
        except InferenceServerException as exc:
            return 504 if "504" in str(exc.status()) or "DEADLINE" in str(exc.status()) else 0
    return 200


#: each route's call that sends its deadline and waits on past it: the status it got
SENT = {
    "prefill": _sent_prefill,
    "region socket": _sent_region_call,
    "v2 http": lambda s, t: _sent_v2(triton_http, urlparse(s.url).netloc, t),
    "v2 grpc": lambda s, t: _sent_v2(triton_grpc, s.grpc_target, t),
}


@pytest.mark.slow
@pytest.mark.parametrize("route", SENT)
def test_a_queued_call_is_dropped_at_the_deadline_its_caller_sent(server, route):
    before = _queries(server)
    with _worker_busy(server) as busy:
        t0 = time.monotonic()
        status = SENT[route](server, _tensors())
        answered = time.monotonic() - t0
        still_busy = "status" not in busy
    assert status == 504
    assert DEADLINE_S - 0.05 < answered < DEADLINE_S + 1.5, answered
    assert still_busy, "answered at the caller's deadline, not once the worker was free"
    assert busy["status"] == 200
    assert eventually(lambda: _queries(server) - before == BUSY_TOKENS, 10), (
        _queries(server) - before
    )
