"""A request the server never read is sent again, once, on another connection, within the call's
deadline (`_resend.Resend`): the service closes idle keep-alive connections at its connection cap,
and such a close may cross the client's next request on it. Servers written by hand
(tests/client/fake_server.py) make that crossing happen every time: they act once the request's
bytes came. Each case runs the blocking and the asyncio client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

import pytest
import torch

import zen_mla
from tests.batches import BATCH_SPECS, BatchSpec, make_batch
from tests.client.clients import CLIENTS
from tests.client.fake_server import (
    Act,
    KeepAliveServer,
    answer,
    closed,
    displaced,
    elapsed,
    read_then,
    reset,
    response,
)
from zen_mla.client import AsyncPrefillClient, PrefillClient

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
BATCHES: list[Batch] = [
    make_batch(BATCH_SPECS["ragged"], (2, 64, 32), torch.bfloat16, seed=s)[:4] for s in (0, 1)
]

#: what the server does with a request it never reads, and what the call raises when the second
#: send meets it too
NEVER_READ: dict[str, tuple[Act, type[zen_mla.ZenMLAError]]] = {
    "the 408 of a displaced idle connection": (displaced, zen_mla.RequestTimeoutError),
    "a close before any answer": (closed, zen_mla.ServiceUnavailableError),
    "a reset before any answer": (reset, zen_mla.ServiceUnavailableError),
}

_PROBLEM = {"Content-Type": "application/problem+json"}
_HEAD_ONLY = response(200, b"\0" * 16, {"Content-Length": "4096"}, length=False)
_PART_OF_A_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/oc"

#: what the server does with a request it read, and what the call raises
READ: dict[str, tuple[Act, type[zen_mla.ZenMLAError]]] = {
    "a 500": (
        read_then(response(500, b'{"detail": "the kernel failed"}', _PROBLEM)),
        zen_mla.KernelError,
    ),
    "a 422": (
        read_then(response(422, json.dumps({"detail": "v is wrong"}).encode(), _PROBLEM)),
        zen_mla.InvalidInputError,
    ),
    "a malformed answer": (
        read_then(b"HTTP/1.1 two hundred\r\n\r\n"),
        zen_mla.ServiceUnavailableError,
    ),
    "a close after the answer's head": (read_then(_HEAD_ONLY), zen_mla.ServiceUnavailableError),
    "a reset after the answer's head": (
        read_then(_HEAD_ONLY, then_reset=True),
        zen_mla.ServiceUnavailableError,
    ),
    "a close after part of the answer's head": (
        read_then(_PART_OF_A_HEAD),
        zen_mla.ServiceUnavailableError,
    ),
    "a reset after part of the answer's head": (
        read_then(_PART_OF_A_HEAD, then_reset=True),
        zen_mla.ServiceUnavailableError,
    ),
    "a close after the status line's first byte": (
        read_then(b"H"),
        zen_mla.ServiceUnavailableError,
    ),
}


def prefills(kind: str, url: str | list[str], batches: list[Batch], **kwargs: Any) -> list[Any]:
    """`batches` prefilled in turn by one client of `kind` (over one kept connection, where the
    server keeps it)."""
    kwargs = {"timeout": 30.0, "shared_memory": False} | kwargs

    def sync() -> list[Any]:
        with PrefillClient(url, **kwargs) as client:
            return [client.prefill(*batch) for batch in batches]

    async def asynchronous() -> list[Any]:
        async with AsyncPrefillClient(url, **kwargs) as client:
            return [await client.prefill(*batch) for batch in batches]

    return sync() if kind == "sync" else asyncio.run(asynchronous())


def hold(conn: socket.socket, stop: threading.Event) -> bool:
    """The request read, and never answered."""
    conn.recv(1 << 20)
    stop.wait(30)
    return False


def after(seconds: float, act: Act) -> Act:
    def late(conn: socket.socket, stop: threading.Event) -> bool:
        return not stop.wait(seconds) and act(conn, stop)

    return late


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", NEVER_READ)
def test_a_request_the_server_never_read_is_sent_again(kind, case):
    """The kept connection's second request meets it; a new connection answers it."""
    never_read, _ = NEVER_READ[case]
    with KeepAliveServer(lambda c, r: never_read if (c, r) == (0, 1) else answer) as server:
        got = prefills(kind, server.url, BATCHES)
    assert server.arrived == [(0, 0), (0, 1), (1, 0)]
    for out, (q, k, v, cu) in zip(got, BATCHES, strict=True):
        assert torch.equal(out, zen_mla.ragged_attention(q, k, v, cu))


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_large_request_is_sent_again_whole(kind):
    """After a small call (its connection kept), a large one meets it: its body, sent in parts,
    goes again from its first part, and its answer of 1 MiB or more (read past httpx by the
    blocking client) comes whole."""
    # q 1.7 MiB (sent in parts of 256 KiB), out 1.2 MiB (read past httpx by PrefillClient)
    q, k, v, cu, _ = make_batch(BatchSpec([1184]), (4, 192, 128), torch.bfloat16)
    with KeepAliveServer(lambda c, r: displaced if (c, r) == (0, 1) else answer) as server:
        got = prefills(kind, server.url, [BATCHES[0], (q, k, v, cu)])
    assert server.arrived == [(0, 0), (0, 1), (1, 0)]
    assert torch.equal(got[1], zen_mla.ragged_attention(q, k, v, cu))


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", NEVER_READ)
def test_a_request_is_sent_again_once(kind, case):
    """Every request after the first meets it: the second call sends twice, then raises."""
    never_read, raised = NEVER_READ[case]
    with (
        KeepAliveServer(lambda c, r: answer if (c, r) == (0, 0) else never_read) as server,
        pytest.raises(raised),
    ):
        prefills(kind, server.url, BATCHES)
    assert server.arrived == [(0, 0), (0, 1), (1, 0)]


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", READ)
def test_a_request_the_server_read_is_not_sent_again(kind, case):
    """Guards the rule's other side: with this failure on the kept connection's second request,
    and right answers on any other, the call raises it, having sent once."""
    read, raised = READ[case]
    with (
        KeepAliveServer(lambda c, r: read if (c, r) == (0, 1) else answer) as server,
        pytest.raises(raised),
    ):
        prefills(kind, server.url, BATCHES)
    assert server.arrived == [(0, 0), (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", NEVER_READ)
def test_the_second_send_ends_at_the_calls_deadline(kind, case):
    """The first send meets it after 1 s, the second is never answered: the call ends at its
    2 s timeout, not later, having sent twice."""
    never_read, _ = NEVER_READ[case]
    with (
        KeepAliveServer(lambda c, r: after(1.0, never_read) if c == 0 else hold) as server,
        elapsed() as t,
        pytest.raises(zen_mla.DeadlineExceededError, match="timeout of 2 s"),
    ):
        prefills(kind, server.url, BATCHES[:1], timeout=2)
    assert server.arrived == [(0, 0), (1, 0)]
    assert t[0] < 2 + 1.0, t


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", READ)
def test_a_request_the_server_read_is_not_sent_to_another_endpoint(kind, case):
    """Two endpoints: the first one's failure (its first request, on its first connection) is
    the call's, the request having arrived once in all; the second endpoint never sees it."""
    read, raised = READ[case]
    with (
        KeepAliveServer(lambda c, r: read) as first,
        KeepAliveServer(lambda c, r: answer) as second,
        pytest.raises(raised),
    ):
        prefills(kind, [first.url, second.url], BATCHES[:1])
    assert (first.arrived, second.arrived) == ([(0, 0)], [])


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", ["a close before any answer", "a reset before any answer"])
def test_a_request_no_endpoint_read_goes_to_another(kind, case):
    """Guards the rule's other side: the first endpoint closes every connection before any
    answer (the request sent there twice, `Resend`), the second answers it."""
    never_read, _ = NEVER_READ[case]
    with (
        KeepAliveServer(lambda c, r: never_read) as first,
        KeepAliveServer(lambda c, r: answer) as second,
    ):
        (got,) = prefills(kind, [first.url, second.url], BATCHES[:1])
    assert (first.arrived, second.arrived) == ([(0, 0), (1, 0)], [(0, 0)])
    q, k, v, cu = BATCHES[0]
    assert torch.equal(got, zen_mla.ragged_attention(q, k, v, cu))
