"""A region the service will not take now (its registration refused: the user's byte budget
spent, its region count, the service's total, no descriptor to spare) costs a client with
`shared_memory=None` nothing but the regions: that call goes over TCP, with the same answer; the
refusal stands a while (`_offers.RECHECK_REFUSED_S`), then regions are tried again. With
`shared_memory=True` the refusal is the call's error. By hand-written stand-ins (a region socket
that refuses every registration, tests/client/fake_server.py) and on a real server whose
per-user budget (`--shm-max-bytes`) another connection of this user holds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import zen_mla
from tests.batches import BATCH_SPECS, make_batch
from tests.client.clients import CLIENTS, bounded
from tests.client.fake_server import (
    FakeRegionSocket,
    FakeServer,
    Request,
    frame,
    response,
    safetensors_body,
)
from tests.processes import wait_for
from tests.service.region_clients import region_socket
from tests.service.servers import Server, serve, server_fixture
from zen_mla.client import AsyncPrefillClient, PrefillClient
from zen_mla.client import _offers as offers
from zen_mla.regions.connection import RegionConnection
from zen_mla.regions.memfd import create_sealed_memfd

TQ, H, DQK, DV = 8, 2, 192, 128

#: a registration refused for a reason of the moment, and the error it is
REFUSALS: dict[str, tuple[dict[str, Any], type[zen_mla.ZenMLAError]]] = {
    "the user's byte budget": (
        {"status": 422, "error": "region: expected at most 1024 bytes of regions per client"},
        zen_mla.InvalidInputError,
    ),
    "the service's total": (
        {"status": 503, "error": "region: the service holds 8 bytes; try again later"},
        zen_mla.ServiceUnavailableError,
    ),
}


def _batch() -> tuple[torch.Tensor, ...]:
    q = torch.randn(TQ, H, DQK, dtype=torch.bfloat16)
    v = torch.randn(TQ, H, DV, dtype=torch.bfloat16)
    return q, q.clone(), v, torch.tensor([0, TQ], dtype=torch.int32)


def _prefill(kind: str, url: str, batch: tuple[torch.Tensor, ...], **kwargs: Any) -> Any:
    """One prefill of `batch` with a fresh client of `kind`."""
    kwargs = {"timeout": 10.0, "retries": 0} | kwargs

    def sync() -> Any:
        with PrefillClient(url, **kwargs) as client:
            return client.prefill(*batch)

    async def asynchronous() -> Any:
        async with AsyncPrefillClient(url, **kwargs) as client:
            return await client.prefill(*batch)

    return bounded(sync if kind == "sync" else lambda: asyncio.run(asynchronous()))


@pytest.fixture
def refusing() -> Iterator[tuple[FakeServer, list[dict[str, Any]]]]:
    """A service whose /health offers a region socket that refuses every registration (with
    the refusal the test puts in the list it is given), and whose /prefill over TCP answers
    out = 0.5 everywhere; `server.requests` lists what came over HTTP."""
    refusal: list[dict[str, Any]] = [{}]

    def reply(message: dict[str, Any], conn: socket.socket, stop: threading.Event) -> None:
        if message["op"] == "hello":
            conn.sendall(frame({"ok": True, "instance": "fake"}))
        else:
            conn.sendall(frame({"ok": False} | refusal[0]))

    with FakeRegionSocket(reply) as regions:

        def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
            if request.path == "/health":
                offer = {"socket": regions.path, "instance": "fake"}
                body = {"status": "ok", "shared_memory": offer}
                conn.sendall(response(200, json.dumps(body).encode()))
                return
            assert request.headers["content-type"] == "application/octet-stream"
            out = torch.full((TQ, H, DV), 0.5, dtype=torch.bfloat16)
            conn.sendall(response(200, safetensors_body({"out": out})))

        with FakeServer(answer) as server:
            yield server, refusal


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_region_sends_the_call_over_tcp(kind, case, refusing):
    server, refusal = refusing
    refusal[0], _ = REFUSALS[case]
    out = _prefill(kind, server.url, _batch())
    assert torch.equal(out, torch.full((TQ, H, DV), 0.5, dtype=torch.bfloat16))
    assert [r.path for r in server.requests] == ["/health", "/prefill"]


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", REFUSALS)
def test_required_regions_raise_the_refusal(kind, case, refusing):
    server, refusal = refusing
    refusal[0], raised = REFUSALS[case]
    with pytest.raises(raised, match=refusal[0]["error"][:20]):
        _prefill(kind, server.url, _batch(), shared_memory=True)
    assert [r.path for r in server.requests] == ["/health"]


# -- on a real server ----------------------------------------------------------------------------

MiB = 1 << 20
BUDGET = 32 * MiB  # one user's regions; a client's first scratch region is 16 MiB


@server_fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("budget"), workers=1, shm_max_bytes=BUDGET) as s:
        yield s


@contextlib.contextmanager
def budget_spent(server: Server) -> Iterator[None]:
    """The server's budget for this user held whole, by another connection of this user's,
    until the block ends."""
    holder = RegionConnection(region_socket(server), None)
    fd = create_sealed_memfd(BUDGET)
    try:

        def registered() -> bool:
            try:
                holder.register(fd)
            except zen_mla.InvalidInputError:
                return False
            return True

        # until the server has read that an earlier holder's socket closed
        wait_for(registered, 5, "the budget stayed taken")
        yield
    finally:
        holder.close()
        os.close(fd)


@pytest.mark.slow
@pytest.mark.parametrize("kind", CLIENTS)
def test_with_the_budget_spent_the_call_goes_over_tcp(kind, budgeted):
    q, k, v, cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 32), torch.bfloat16)
    with budget_spent(budgeted):
        out = _prefill(kind, budgeted.url, (q, k, v, cu))
        assert torch.equal(out, zen_mla.ragged_attention(q, k, v, cu))
        with pytest.raises(zen_mla.InvalidInputError, match="bytes of regions per client"):
            _prefill(kind, budgeted.url, (q, k, v, cu), shared_memory=True)


@pytest.mark.slow
def test_regions_are_tried_again_once_the_refusal_no_longer_stands(budgeted):
    """The budget spent: the call goes over TCP, and the refusal stands a while; the budget free
    and the refusal's time past, the next call lays its request out in a region."""
    q, k, v, cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 32), torch.bfloat16)
    want = zen_mla.ragged_attention(q, k, v, cu)
    with PrefillClient(budgeted.url, timeout=30.0) as client:
        with budget_spent(budgeted):
            assert torch.equal(client.prefill(q, k, v, cu), want)
            offer = client._balancer.at(0).offer
            assert offer is not None and offer.regions is not None and offer.for_calls() is None
            assert offer.refused_until - time.monotonic() <= offers.RECHECK_REFUSED_S

        def used_again() -> bool:
            offer.refused_until = 0.0  # the refusal's time passed
            assert torch.equal(client.prefill(q, k, v, cu), want)
            return offer.for_calls() is not None

        # until the service has read that the holder's connection closed
        wait_for(used_again, 10, "the regions were not used again", 0.1)
