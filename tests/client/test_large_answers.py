"""Large answers (1 MiB and more): the blocking client reads them from the socket straight into
its answer memory, and both clients reuse that memory once a call's results are dropped. Against
hand-written servers (tests/client/fake_server.py); the real service's are in
tests/service/routes/test_prefill.py."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time

import httpx
import pytest
import torch

import zen_mla
from tests.client.clients import CLIENTS, bounded
from tests.client.fake_server import (
    FakeServer,
    Request,
    chunked,
    response,
    safetensors_body,
    trickle,
)
from zen_mla.client import AsyncPrefillClient, PrefillClient
from zen_mla.client._memory import MIN_BYTES, AnswerMemory

TQ, H, DQK, DV = 4096, 2, 192, 128  # an answer of 2 MiB


def big_batch() -> tuple[torch.Tensor, ...]:
    q = torch.randn(TQ, H, DQK, dtype=torch.bfloat16)
    v = torch.randn(TQ, H, DV, dtype=torch.bfloat16)
    return q, q.clone(), v, torch.tensor([0, TQ], dtype=torch.int32)


def big_answer(return_lse: bool = False) -> dict[str, torch.Tensor]:
    """Random numbers: a byte landing in the wrong place shows."""
    tensors = {"out": torch.randn(TQ, H, DV).bfloat16()}
    if return_lse:
        tensors["lse"] = torch.randn(H, TQ)
    return tensors


def sent_in_two(whole: bytes, cut: int, pause: float = 0.05):
    """An answer written as `whole[:cut]`, a pause (the client reads the first part alone),
    then the rest."""

    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(whole[:cut])
        time.sleep(pause)
        conn.sendall(whole[cut:])

    return answer


OPTIONS = {"timeout": 10.0, "retries": 0, "shared_memory": False}


def calls(kind: str, url: str, n: int, between=lambda results: None) -> list[torch.Tensor]:
    """`n` prefills of one `big_batch()` on one client of `kind`; `between(results so far)` runs
    after each."""
    q, k, v, cu = big_batch()
    if kind == "sync":

        def run() -> list[torch.Tensor]:
            results: list[torch.Tensor] = []
            with PrefillClient(url, **OPTIONS) as client:
                for _ in range(n):
                    results.append(client.prefill(q, k, v, cu))
                    between(results)
            return results

        return bounded(run)

    async def run_async() -> list[torch.Tensor]:
        results: list[torch.Tensor] = []
        async with AsyncPrefillClient(url, **OPTIONS) as client:
            for _ in range(n):
                results.append(await client.prefill(q, k, v, cu))
                between(results)
        return results

    return bounded(lambda: asyncio.run(run_async()))


#: where the first write of the answer ends: with the headers (httpx holds no body byte when
#: the rest is read from the socket), a byte or 64 KiB into the body, or all at once
SPLITS = ["headers", "headers + 1", "headers + 64 KiB", "whole"]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("return_lse", [False, True])
def test_a_large_answer_arrives_whole_however_it_is_split(split, return_lse):
    want = big_answer(return_lse)
    whole = response(200, safetensors_body(want))
    head = whole.index(b"\r\n\r\n") + 4
    cut = {"headers": head, "headers + 1": head + 1, "headers + 64 KiB": head + (64 << 10)}
    q, k, v, cu = big_batch()
    with (
        FakeServer(sent_in_two(whole, cut.get(split, len(whole)))) as server,
        PrefillClient(server.url, timeout=10, retries=0, shared_memory=False) as client,
    ):
        got = bounded(lambda: client.prefill(q, k, v, cu, return_lse=return_lse))
    got = got if return_lse else (got,)
    assert all(torch.equal(g, w) for g, w in zip(got, want.values(), strict=True))


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_large_answer_cut_short_is_a_protocol_error(kind):
    whole = response(200, safetensors_body(big_answer()))

    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(whole[: len(whole) // 2])  # then the connection closes

    # the blocking client reads the socket itself: the answer ended early; httpx (asyncio) says
    # the peer closed mid-body, which is the endpoint gone
    error = zen_mla.ProtocolError if kind == "sync" else zen_mla.ServiceUnavailableError
    with FakeServer(answer) as server, pytest.raises(error):
        calls(kind, server.url, 1)


@pytest.mark.slow
def test_a_large_answer_trickled_ends_at_the_timeout():
    whole = response(200, safetensors_body(big_answer()))
    head = whole.index(b"\r\n\r\n") + 4

    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(whole[: head + (1 << 20)])  # past httpx: the rest is read from the socket
        trickle(conn, whole[head + (1 << 20) :], 0.2, stop)

    q, k, v, cu = big_batch()
    t0 = time.monotonic()
    with (
        FakeServer(answer) as server,
        PrefillClient(server.url, timeout=2, retries=0, shared_memory=False) as client,
        pytest.raises(zen_mla.DeadlineExceededError, match="timeout of 2 s"),
    ):
        bounded(lambda: client.prefill(q, k, v, cu))
    assert time.monotonic() - t0 < 2 + 1.5


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_large_chunked_answer_that_also_has_a_content_length(kind):
    """HTTP reads it chunked (h11 does): the chunks' framing must never be taken for tensor
    bytes, as the socket would give them."""
    want = big_answer()
    data = safetensors_body(want)
    whole = response(200, chunked(data, 1 << 16), {"Transfer-Encoding": "chunked"})
    whole = whole.replace(
        b"Content-Length: %d" % len(chunked(data, 1 << 16)), b"Content-Length: %d" % len(data)
    )
    head = whole.index(b"\r\n\r\n") + 4
    with FakeServer(sent_in_two(whole, head)) as server:
        got = calls(kind, server.url, 1)
    assert torch.equal(got[0], want["out"])


def test_bytes_past_the_content_length_are_not_taken():
    want = big_answer()
    whole = response(200, safetensors_body(want)) + b"\xff" * (1 << 20)
    q, k, v, cu = big_batch()
    with (
        FakeServer(sent_in_two(whole, whole.index(b"\r\n\r\n") + 4)) as server,
        PrefillClient(server.url, timeout=10, retries=0, shared_memory=False) as client,
    ):
        got = bounded(lambda: client.prefill(q, k, v, cu))
    assert torch.equal(got, want["out"])


@pytest.mark.parametrize("kind", CLIENTS)
def test_large_answers_one_after_another_on_one_client(kind):
    """The connection a direct read leaves is closed; the next call opens another."""
    answers = [big_answer() for _ in range(3)]
    served = iter(answers)

    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(response(200, safetensors_body(next(served))))

    with FakeServer(answer) as server:
        got = calls(kind, server.url, len(answers))
    assert all(torch.equal(g, w["out"]) for g, w in zip(got, answers, strict=True))


# -- the answer memory ---------------------------------------------------------------------------


def test_memory_is_reused_only_once_its_results_are_gone():
    memory = AnswerMemory(64 << 20)
    first = torch.frombuffer(memory.take(3 << 20), dtype=torch.uint8)
    first.fill_(1)
    second = torch.frombuffer(memory.take(3 << 20), dtype=torch.uint8)
    assert first.data_ptr() != second.data_ptr(), "handed out twice while in use"
    view = first[10:20]  # a view keeps the memory as the tensor does
    address = first.data_ptr()
    del first
    gc.collect()
    other = torch.frombuffer(memory.take(3 << 20), dtype=torch.uint8)
    assert other.data_ptr() != address, "handed out while a view of it lives"
    assert view.eq(1).all()
    del view
    gc.collect()
    assert memory.idle_bytes > 0
    third = torch.frombuffer(memory.take(3 << 20), dtype=torch.uint8)
    assert third.data_ptr() == address, "memory given back is reused"


def test_memory_keeps_at_most_its_bound_and_nothing_once_closed():
    memory = AnswerMemory(8 << 20)
    held = [torch.frombuffer(memory.take(3 << 20), dtype=torch.uint8) for _ in range(4)]
    del held
    gc.collect()
    assert 0 < memory.idle_bytes <= 8 << 20
    small = memory.take(MIN_BYTES)
    assert len(small) == MIN_BYTES  # a 4 MiB buffer is not spent on 1 MiB
    memory.close()
    assert memory.idle_bytes == 0
    del small
    gc.collect()
    assert memory.idle_bytes == 0


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_client_reuses_the_memory_of_a_dropped_result(kind):
    want = big_answer()
    body = response(200, safetensors_body(want))
    addresses: list[int] = []

    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(body)

    def between(results: list[torch.Tensor]) -> None:
        """The first result is held through the second call, then dropped (its value kept)."""
        addresses.append(results[-1].untyped_storage().data_ptr())
        assert torch.equal(results[-1], want["out"])
        if len(results) == 2:
            results[0] = results[0].clone()
            gc.collect()

    with FakeServer(answer) as server:
        calls(kind, server.url, 3, between)
    first, second, third = addresses
    assert second != first, "the memory of a result still held was handed out again"
    assert third == first, "the memory of a dropped result is reused"


def test_a_large_answer_is_asked_with_connection_close():
    """Its connection cannot serve another request once read past httpx: the service is asked
    to close it (its TIME_WAIT is then the service's, not one of this host's ports each call).
    A small answer keeps the connection; so does every answer through a transport of the
    caller's own (read through httpx)."""
    big, small = big_answer(), {"out": torch.zeros(1, H, DV, dtype=torch.bfloat16)}

    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        large = len(request.body) > 1 << 20  # the big batch's request
        conn.sendall(response(200, safetensors_body(big if large else small)))

    q, k, v, cu = big_batch()
    one = (q[:1], k[:1], v[:1], torch.tensor([0, 1], dtype=torch.int32))
    with FakeServer(answer) as server:
        for transport in (None, httpx.HTTPTransport()):
            with PrefillClient(server.url, transport=transport, **OPTIONS) as client:
                assert torch.equal(bounded(lambda: client.prefill(q, k, v, cu)), big["out"])
                assert torch.equal(bounded(lambda: client.prefill(*one)), small["out"])
    asked = [r.headers.get("connection") for r in server.requests]
    assert asked == ["close", "keep-alive", "keep-alive", "keep-alive"], asked


def test_a_service_that_says_it_closes_and_does_not_is_not_waited_for():
    """After a large answer the client waits for the service's end of the connection (it said
    `Connection: close`), briefly: a service that keeps it open costs the call no more."""
    want = big_answer()

    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(response(200, safetensors_body(want)))  # says Connection: close
        stop.wait(5)  # and keeps the connection open

    q, k, v, cu = big_batch()
    with (
        FakeServer(answer) as server,
        PrefillClient(server.url, **OPTIONS) as client,
    ):
        t0 = time.monotonic()
        got = bounded(lambda: client.prefill(q, k, v, cu))
        took = time.monotonic() - t0
    assert torch.equal(got, want["out"])
    assert took < 1.0, took
