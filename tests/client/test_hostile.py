"""The client against hostile servers written by hand (tests/client/fake_server.py): every
failure is a ZenMLAError, within the call's timeout, having read no more than the request can
need; a wrong answer is never returned. Each case runs the blocking and the asyncio client."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import zen_mla
from tests.client.clients import CLIENTS, bounded
from tests.client.fake_server import (
    FakeRegionSocket,
    FakeServer,
    Request,
    chunked,
    elapsed,
    frame,
    response,
    safetensors_body,
    trickle,
)
from zen_mla.client import AsyncPrefillClient, PrefillClient
from zen_mla.regions.connection import RegionConnection

TQ, H, DQK, DV = 8, 2, 192, 128
TIB = 1 << 40


def batch() -> tuple[torch.Tensor, ...]:
    q = torch.randn(TQ, H, DQK, dtype=torch.bfloat16)
    v = torch.randn(TQ, H, DV, dtype=torch.bfloat16)
    return q, q.clone(), v, torch.tensor([0, TQ], dtype=torch.int32)


def right(return_lse: bool = False) -> dict[str, torch.Tensor]:
    """What the service must answer for `batch()`."""
    tensors = {"out": torch.full((TQ, H, DV), 0.5, dtype=torch.bfloat16)}
    if return_lse:
        tensors["lse"] = torch.full((H, TQ), -1.0)
    return tensors


def prefill(kind: str, url: str, *, return_lse: bool = False, **kwargs: Any) -> Any:
    """One prefill of `batch()` with a fresh client of `kind`."""
    kwargs = {"timeout": 5.0, "retries": 0, "shared_memory": False} | kwargs
    q, k, v, cu = batch()

    def sync() -> Any:
        with PrefillClient(url, **kwargs) as client:
            return client.prefill(q, k, v, cu, return_lse=return_lse)

    async def asynchronous() -> Any:
        async with AsyncPrefillClient(url, **kwargs) as client:
            return await client.prefill(q, k, v, cu, return_lse=return_lse)

    return bounded(sync if kind == "sync" else lambda: asyncio.run(asynchronous()))


def health(kind: str, url: str, **kwargs: Any) -> Any:
    kwargs = {"timeout": 5.0} | kwargs

    def sync() -> Any:
        with PrefillClient(url, **kwargs) as client:
            return client.health()

    async def asynchronous() -> Any:
        async with AsyncPrefillClient(url, **kwargs) as client:
            return await client.health()

    return bounded(sync if kind == "sync" else lambda: asyncio.run(asynchronous()))


def answering(raw: bytes) -> Callable[[Request, socket.socket, threading.Event], None]:
    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(raw)

    return answer


# -- 9, 21: one deadline for the whole call ------------------------------------------------------

#: the status line and headers a byte at a time (httpx's per-read timeout never trips), or the
#: headers at once and the body a byte at a time
TRICKLES = ["head", "body"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("where", TRICKLES)
def test_a_trickled_answer_ends_at_the_timeout(kind, where):
    whole = response(200, safetensors_body(right()))
    split = whole.index(b"\r\n\r\n") + 4 if where == "body" else 0

    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(whole[:split])
        trickle(conn, whole[split:], 0.5, stop)

    with (
        FakeServer(answer) as server,
        elapsed() as t,
        pytest.raises(zen_mla.DeadlineExceededError, match="timeout of 2 s"),
    ):
        prefill(kind, server.url, timeout=2)
    assert t[0] < 2 + 1.5, t


@pytest.mark.slow
@pytest.mark.parametrize("kind", CLIENTS)
def test_a_trickled_health_ends_at_the_timeout(kind):
    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        trickle(conn, response(200, b'{"status": "ok"}'), 0.5, stop)

    with (
        FakeServer(answer) as server,
        elapsed() as t,
        pytest.raises(zen_mla.DeadlineExceededError),
    ):
        health(kind, server.url, timeout=1.5)
    assert t[0] < 1.5 + 1.5, t


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_retry_after_past_the_timeout_is_not_waited(kind):
    busy = response(429, b'{"detail": "full"}', {"Retry-After": "99999"})
    with (
        FakeServer(answering(busy)) as server,
        elapsed() as t,
        pytest.raises(zen_mla.QueueFullError) as info,
    ):
        prefill(kind, server.url, timeout=2, retries=3)
    assert t[0] < 1.0, t
    assert info.value.retry_after == 99999
    assert len(server.requests) == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", CLIENTS)
def test_retries_stay_inside_the_timeout(kind):
    busy = response(503, b'{"detail": "draining"}', {"Retry-After": "1"})
    with (
        FakeServer(answering(busy)) as server,
        elapsed() as t,
        pytest.raises(zen_mla.ServiceUnavailableError),
    ):
        prefill(kind, server.url, timeout=2.5, retries=5)
    # tried at 0 s, 1 s and 2 s; the next wait would end past 2.5 s
    assert len(server.requests) == 3
    assert t[0] < 2.5 + 1.0, t


# -- 10: a wrong answer is never returned --------------------------------------------------------

WRONG_ANSWERS: dict[str, tuple[bool, dict[str, torch.Tensor]]] = {
    "out [1, 1, 1]": (False, {"out": torch.zeros(1, 1, 1, dtype=torch.bfloat16)}),
    "out fp32 for bf16 inputs": (False, {"out": torch.zeros(TQ, H, DV)}),
    "out [Tq, H, Dqk]": (False, {"out": torch.zeros(TQ, H, DQK, dtype=torch.bfloat16)}),
    "no out": (True, {"lse": torch.zeros(H, TQ)}),
    "lse not asked for": (False, right(return_lse=True)),
    "lse missing": (True, right()),
    "lse bf16": (True, right() | {"lse": torch.zeros(H, TQ, dtype=torch.bfloat16)}),
    "lse [Tq, H]": (True, right() | {"lse": torch.zeros(TQ, H)}),
    "an unknown name": (False, right() | {"extra": torch.zeros(1)}),
}


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", WRONG_ANSWERS)
def test_a_wrong_answer_is_a_protocol_error(kind, case):
    return_lse, tensors = WRONG_ANSWERS[case]
    with (
        FakeServer(answering(response(200, safetensors_body(tensors)))) as server,
        pytest.raises(zen_mla.ProtocolError),
    ):
        prefill(kind, server.url, return_lse=return_lse)


UNREADABLE = {
    "empty": b"",
    "not safetensors": b"<html>hello</html>",
    "a header of 1 TiB": (TIB).to_bytes(8, "little") + b"{}",
    "a header that is a list": (2).to_bytes(8, "little") + b"[]",
    "a number of 5000 digits": (5010).to_bytes(8, "little") + b'{"a":' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", UNREADABLE)
def test_an_unreadable_answer_is_a_protocol_error(kind, case):
    with (
        FakeServer(answering(response(200, UNREADABLE[case]))) as server,
        pytest.raises(zen_mla.ProtocolError),
    ):
        prefill(kind, server.url)


# -- 11: reads bounded by what the request can need; every failure a ZenMLAError ---------------

FRAMINGS = {
    "content-length": lambda body: response(200, body),
    "chunked": lambda body: response(
        200, chunked(body), {"Transfer-Encoding": "chunked"}, length=False
    ),
    "until close": lambda body: response(200, body, length=False),
}


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("return_lse", [False, True])
def test_a_right_answer_in_any_framing(kind, framing, return_lse):
    want = right(return_lse)
    with FakeServer(answering(FRAMINGS[framing](safetensors_body(want)))) as server:
        got = prefill(kind, server.url, return_lse=return_lse)
    got = got if return_lse else (got,)
    assert all(torch.equal(g, w) for g, w in zip(got, want.values(), strict=True))


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("framing", ["chunked", "until close"])
def test_an_answer_past_what_the_request_needs_is_not_read(kind, framing):
    huge = safetensors_body(right()) + b"\0" * (8 << 20)
    with (
        FakeServer(answering(FRAMINGS[framing](huge))) as server,
        pytest.raises(zen_mla.ProtocolError, match="runs past"),
    ):
        prefill(kind, server.url)


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("status", [200, 500])
def test_a_content_length_of_a_tib_is_not_read(kind, status):
    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(response(status, b"", {"Content-Length": str(TIB)}, length=False))
        stop.wait(10)  # and nothing more

    with FakeServer(answer) as server, elapsed() as t:
        want = zen_mla.ProtocolError if status == 200 else zen_mla.KernelError
        with pytest.raises(want):
            prefill(kind, server.url, timeout=5)
    assert t[0] < 2.5, t  # no wait for the bytes (nor a MemoryError for them)


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("status", [200, 503])
def test_a_huge_health_is_not_read(kind, status):
    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(response(status, b"", {"Content-Length": str(TIB)}, length=False))
        stop.wait(10)

    with FakeServer(answer) as server, elapsed() as t, pytest.raises(zen_mla.ZenMLAError):
        health(kind, server.url, timeout=5)
    assert t[0] < 2.5, t


HEALTH_BODIES = {
    "not JSON": b"<html>ok</html>",
    "a JSON list": b'[{"status": "ok"}]',
    "a JSON string": b'"ok"',
    "empty": b"",
}


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", HEALTH_BODIES)
def test_a_health_that_is_not_a_json_object(kind, case):
    with (
        FakeServer(answering(response(200, HEALTH_BODIES[case]))) as server,
        pytest.raises(zen_mla.ProtocolError, match="/health"),
    ):
        health(kind, server.url)


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", HEALTH_BODIES)
def test_a_broken_health_leaves_prefill_on_http(kind, case):
    def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
        if request.path == "/health":
            conn.sendall(response(200, HEALTH_BODIES[case]))
        else:
            conn.sendall(response(200, safetensors_body(right())))

    with FakeServer(answer) as server:
        assert torch.equal(prefill(kind, server.url, shared_memory=None), right()["out"])
        with pytest.raises(zen_mla.SharedMemoryUnavailableError, match="/health"):
            prefill(kind, server.url, shared_memory=True)


# -- 25: the problem's hint crosses HTTP; no assert on what came -------------------------------

HINTED = {
    "type": "urn:zen-mla:problem:InvalidInputError",
    "title": "Unprocessable Content",
    "status": 422,
    "detail": "v: expected Dv <= Dqk, got Dv=256. Pass v as [Tk, H, Dv]",
    "tensor": "v",
    "expected": "Dv <= Dqk",
    "got": "Dv=256",
    "hint": "Pass v as [Tk, H, Dv]",
}


@pytest.mark.parametrize("kind", CLIENTS)
def test_the_fix_hint_crosses_http(kind):
    body = json.dumps(HINTED).encode()
    problem = response(422, body, {"Content-Type": "application/problem+json"})
    with (
        FakeServer(answering(problem)) as server,
        pytest.raises(zen_mla.InvalidInputError) as info,
    ):
        prefill(kind, server.url)
    exc = info.value
    assert (exc.name, exc.expected, exc.got, exc.hint) == (
        "v",
        "Dv <= Dqk",
        "Dv=256",
        HINTED["hint"],
    )
    assert str(exc) == HINTED["detail"]


PROBLEM_BODIES = {
    "a JSON list": (422, b'["v is wrong"]', zen_mla.InvalidInputError),
    "a JSON number": (500, b"42", zen_mla.KernelError),
    "html": (503, b"<html>busy</html>", zen_mla.ServiceUnavailableError),
    "a hint that is not a string": (
        422,
        json.dumps(HINTED | {"hint": [1]}).encode(),
        zen_mla.InvalidInputError,
    ),
    "a type naming no class": (
        500,
        b'{"type": "urn:x:BY_STATUS", "detail": "d"}',
        zen_mla.KernelError,
    ),
    "Retry-After in superscript": (429, b"{}", zen_mla.QueueFullError),
}


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", PROBLEM_BODIES)
def test_any_problem_body_gives_the_status_class(kind, case):
    status, body, cls = PROBLEM_BODIES[case]
    raw = response(status, body, {"Retry-After": "\u00b2"})
    with FakeServer(answering(raw)) as server, pytest.raises(cls) as info:
        prefill(kind, server.url)
    assert str(info.value)  # readable


@pytest.mark.slow
def test_a_problem_that_is_a_list_under_optimize():
    """asserts are gone under -O: what came from the network is checked without them."""
    problem = response(422, b'["v is wrong"]', {"Content-Type": "application/problem+json"})
    script = (
        "import torch, zen_mla\n"
        "from zen_mla.client import PrefillClient\n"
        "q = torch.randn(4, 1, 8)\n"
        "with PrefillClient(URL, shared_memory=False, retries=0, timeout=10) as c:\n"
        "    try:\n"
        "        c.prefill(q, q, q, torch.tensor([0, 4]))\n"
        "    except BaseException as exc:\n"
        "        print(type(exc).__name__, exc)\n"
    )
    with FakeServer(answering(problem)) as server:
        out = subprocess.run(
            [sys.executable, "-O", "-c", script.replace("URL", repr(server.url))],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.stdout.startswith("InvalidInputError"), out.stdout + out.stderr
    assert "v is wrong" in out.stdout


# -- the same-host regions: their JSON answers and their socket --------------------------------


def region_socket_ok(message: dict[str, Any], conn: socket.socket, stop: threading.Event) -> None:
    replies = {
        "hello": {"ok": True, "instance": "fake", "max_regions": 64},
        "register": {"ok": True, "region": f"r{os.urandom(4).hex()}", "nbytes": 1},
        "unregister": {"ok": True},
    }
    conn.sendall(frame(replies[message["op"]]))


def _moved(place: dict[str, Any], **change: Any) -> dict[str, Any]:
    return place | change


REGION_ANSWERS: dict[str, tuple[bool, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "out [1, 1, 1]": (False, lambda r: {"out": _moved(r["out"], shape=[1, 1, 1])}),
    "out F32": (False, lambda r: {"out": _moved(r["out"], dtype="F32")}),
    "out elsewhere": (False, lambda r: {"out": _moved(r["out"], offset=r["out"]["offset"] + 64)}),
    "no out": (True, lambda r: {"lse": r["lse"]}),
    "lse not asked for": (False, lambda r: {"out": r["out"], "lse": r["out"]}),
    "lse BF16": (True, lambda r: {"out": r["out"], "lse": _moved(r["lse"], dtype="BF16")}),
    "an unknown name": (False, lambda r: {"out": r["out"], "extra": r["out"]}),
    "a list": (False, lambda r: [r["out"]]),  # type: ignore[dict-item, return-value]
}


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("case", REGION_ANSWERS)
def test_a_wrong_region_answer_is_a_protocol_error(kind, case):
    return_lse, wrong = REGION_ANSWERS[case]
    with FakeRegionSocket(region_socket_ok) as regions:

        def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
            if request.path == "/health":
                offer = {"socket": regions.path, "instance": "fake"}
                conn.sendall(response(200, json.dumps({"shared_memory": offer}).encode()))
                return
            assert request.headers["content-type"] == "application/vnd.zen-mla.regions+json"
            conn.sendall(response(200, json.dumps(wrong(json.loads(request.body))).encode()))

        with FakeServer(answer) as server, pytest.raises(zen_mla.ProtocolError):
            prefill(kind, server.url, shared_memory=True, return_lse=return_lse)


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_right_region_answer(kind):
    with FakeRegionSocket(region_socket_ok) as regions:

        def answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
            if request.path == "/health":
                offer = {"socket": regions.path, "instance": "fake"}
                conn.sendall(response(200, json.dumps({"shared_memory": offer}).encode()))
                return
            places = json.loads(request.body)
            answer = {"out": places["out"], "__metadata__": {"kernel": "fake"}}
            conn.sendall(response(200, json.dumps(answer).encode()))

        with FakeServer(answer) as server:
            out = prefill(kind, server.url, shared_memory=True)
    assert out.shape == (TQ, H, DV) and out.dtype == torch.bfloat16


def _replying(
    raw: Callable[[], bytes],
) -> Callable[[dict[str, Any], socket.socket, threading.Event], None]:
    def reply(message: dict[str, Any], conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(raw())

    return reply


def _never(message: dict[str, Any], conn: socket.socket, stop: threading.Event) -> None:
    stop.wait(10)


def _trickled(message: dict[str, Any], conn: socket.socket, stop: threading.Event) -> None:
    trickle(conn, frame({"ok": True, "instance": "x" * 100}), 0.2, stop)


HOSTILE_REPLIES = {
    "a frame of 4 GiB announced": _replying(lambda: (0xFFFFFFFF).to_bytes(4, "big") + b"{}"),
    "garbage JSON": _replying(lambda: (5).to_bytes(4, "big") + b"{nope"),
    "not UTF-8": _replying(lambda: (2).to_bytes(4, "big") + b"\xff\xfe"),
    "a JSON list": _replying(lambda: frame([1, 2])),
    "deep nesting": _replying(lambda: (60000).to_bytes(4, "big") + b"[" * 60000),
    "a refusal of 422": _replying(lambda: frame({"ok": False, "status": 422, "error": "no"})),
    "a refusal with a status that is not a number": _replying(
        lambda: frame({"ok": False, "status": "abc", "error": "no"})
    ),
    "no reply": _never,
    "a trickled reply": _trickled,
}


@pytest.mark.parametrize("case", HOSTILE_REPLIES)
def test_a_hostile_region_socket_at_hello(case):
    with (
        FakeRegionSocket(HOSTILE_REPLIES[case]) as regions,
        elapsed() as t,
        pytest.raises(zen_mla.SharedMemoryUnavailableError),
    ):
        bounded(lambda: RegionConnection(regions.path, None, timeout=0.5))
    assert t[0] < 0.5 + 1.0, t


@pytest.mark.parametrize("case", HOSTILE_REPLIES)
def test_a_hostile_region_socket_at_register(case):
    hostile = HOSTILE_REPLIES[case]

    def reply(message: dict[str, Any], conn: socket.socket, stop: threading.Event) -> None:
        if message["op"] == "hello":
            conn.sendall(frame({"ok": True, "instance": "fake"}))
        else:
            hostile(message, conn, stop)

    with FakeRegionSocket(reply) as regions:
        client = RegionConnection(regions.path, None, timeout=0.5)
        fd = os.memfd_create("test")
        try:
            with elapsed() as t, pytest.raises(zen_mla.ZenMLAError):
                bounded(lambda: client.register(fd))
        finally:
            os.close(fd)
            client.close()
    assert t[0] < 0.5 + 1.0, t


def test_a_region_registered_under_no_name():
    def reply(message: dict[str, Any], conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(frame({"ok": True, "instance": "fake", "region": ["not", "a", "name"]}))

    with FakeRegionSocket(reply) as regions:
        client = RegionConnection(regions.path, None, timeout=1.0)
        fd = os.memfd_create("test")
        try:
            with pytest.raises(zen_mla.ProtocolError):
                client.register(fd)
        finally:
            os.close(fd)
            client.close()
