"""Endpoints that fail without refusing, against servers written by hand
(tests/client/fake_server.py), for both clients: one that takes connections and answers nothing
(`SilentServer`), one whose connects hang (`FullBacklog`). Each costs one call at most, ended by
its deadline, and is then left out, probed, until its `/health/ready` says 200. Behind one name,
against a real server: tests/client/test_names_stalled.py."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from typing import Any

import pytest
import torch

import zen_mla
from tests.batches import BATCH_SPECS, make_batch
from tests.client.clients import CLIENTS, calling
from tests.client.fake_server import (
    FakeServer,
    FullBacklog,
    Request,
    SilentServer,
    prefill_answer,
    response,
)
from tests.processes import wait_for

TIMEOUT = 1.0  # the client's, seconds: a whole call's deadline
CALLS = 8


def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
    """A replica's: ready, and prefills computed."""
    if request.path == "/prefill":
        conn.sendall(prefill_answer(request))
    else:
        conn.sendall(response(200, b'{"status": "ok"}'))


BAD = {
    "silent": lambda: SilentServer("127.0.0.2", 0),
    "hung": lambda: FullBacklog("127.0.0.3", 0),
}


def timed(call: Any, *args: Any) -> tuple[str, float, Any]:
    start = time.monotonic()
    try:
        got, outcome = call(*args), "ok"
    except zen_mla.ZenMLAError as exc:
        got, outcome = None, type(exc).__name__
    return outcome, time.monotonic() - start, got


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("bad", BAD)
def test_an_endpoint_that_times_out_costs_one_call_at_most(kind, bad):
    q, k, v, cu, _ = make_batch(BATCH_SPECS["single"], (1, 16, 16), torch.bfloat16)
    want = zen_mla.ragged_attention(q, k, v, cu)
    with (
        BAD[bad]() as stalled,
        FakeServer(answer) as good,
        calling(kind, [stalled.url, good.url], shared_memory=False, timeout=TIMEOUT) as (
            client,
            call,
        ),
    ):
        calls = [timed(call, q, k, v, cu) for _ in range(CALLS)]
        failed = [c[:2] for c in calls if c[0] != "ok"]
        # the silent one ends its call at the deadline; a hung connect takes a quarter of it,
        # and the call goes on to the other
        assert failed in ([], [("DeadlineExceededError", pytest.approx(TIMEOUT, abs=0.3))])
        assert all(torch.equal(c[2], want) for c in calls if c[0] == "ok")
        assert all(c[1] < 0.1 * TIMEOUT for c in calls[1:]), calls
        assert len([r for r in good.requests if r.path == "/prefill"]) == CALLS - len(failed)
        stalled_ep = client._balancer.at(0)
        assert stalled_ep.down
        if isinstance(stalled, SilentServer):  # probed, not used
            time.sleep(0.3)  # past its first probe's time: the next call launches it
            assert timed(call, q, k, v, cu)[0] == "ok"
            wait_for(
                lambda: ("came", "/health/ready") in stalled.seen(),
                TIMEOUT,
                "the silent endpoint was not probed",
                0.02,
            )
            assert [e for e in stalled.seen() if e[1] == "/prefill"] == [("came", "/prefill")]
            assert stalled_ep.down


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_call_held_by_a_silent_endpoint_holds_up_no_other(kind):
    """Regions asked for (`shared_memory=None`): the silent endpoint's `/health` hangs, and the
    calls meanwhile go to the other endpoint, at once, which stays up."""
    q, k, v, cu, _ = make_batch(BATCH_SPECS["single"], (1, 16, 16), torch.bfloat16)
    with (
        SilentServer("127.0.0.2", 0) as silent,
        FakeServer(answer) as good,
        calling(kind, [silent.url, good.url], timeout=TIMEOUT) as (client, call),
    ):
        held = concurrent.futures.ThreadPoolExecutor(1)
        stuck = held.submit(timed, call, q, k, v, cu)  # the first call: to the first endpoint
        wait_for(lambda: ("came", "/health") in silent.seen(), TIMEOUT, "no /health came", 0.01)
        meanwhile = [timed(call, q, k, v, cu) for _ in range(CALLS)]
        assert stuck.result()[0] == "DeadlineExceededError"
        held.shutdown()
        assert [c[0] for c in meanwhile] == ["ok"] * CALLS
        assert all(c[1] < 0.2 * TIMEOUT for c in meanwhile), meanwhile
        assert client._balancer.at(0).down and not client._balancer.at(1).down
