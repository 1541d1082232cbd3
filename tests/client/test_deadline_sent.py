"""The client sends what is left of its deadline with each attempt (`zen_mla.deadline`): the
`Zen-MLA-Timeout` header on a POST, a region call's `timeout` field; nothing where it has no
deadline."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import httpx
import pytest

from tests.client.clients import CLIENTS
from tests.client.fake_server import FakeServer, Request, prefill_answer
from tests.client.test_hostile import prefill
from zen_mla.deadline import HEADER, Deadline, seconds_text, timeout_of
from zen_mla.errors import InvalidInputError
from zen_mla.regions.protocol import call_fields, decode_message, numbered


def _answer(request: Request, conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(prefill_answer(request))


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_prefill_carries_what_is_left_of_its_deadline(kind):
    with FakeServer(_answer) as server:
        prefill(kind, server.url, timeout=5.0)
        (request,) = server.requests
    sent = float(request.headers[HEADER.lower()])
    assert 3.0 < sent <= 5.0, sent  # the call's 5 s, less what went before the send


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_prefill_without_a_deadline_sends_none(kind):
    unbounded = httpx.Timeout(None)
    with FakeServer(_answer) as server:
        prefill(kind, server.url, timeout=unbounded)
        (request,) = server.requests
    assert HEADER.lower() not in request.headers


def test_a_region_call_frame_carries_its_timeout():
    fields = call_fields({"body": "{}"})
    frame: dict[str, Any] = decode_message(numbered(7, fields, 2.5)[4:])
    assert frame == {"op": "prefill", "call": 7, "timeout": 2.5, "body": "{}"}
    assert "timeout" not in json.loads(numbered(7, fields)[4:])


def test_what_is_sent_is_at_least_a_millisecond():
    assert seconds_text(Deadline(-1.0).remaining() or 0) == "0.001"
    assert float(seconds_text(1.23456)) == 1.235


@pytest.mark.parametrize("bad", ["", "soon", "nan", "inf", "-1", "0", True, None, "1" * 40])
def test_a_timeout_that_is_no_positive_number_is_refused_naming_its_field(bad):
    with pytest.raises(InvalidInputError, match="Zen-MLA-Timeout"):
        timeout_of(bad, HEADER)


def test_a_v2_timeout_is_in_microseconds():
    assert timeout_of(250_000, "timeout", 1e-6) == pytest.approx(0.25)
    assert timeout_of("1.5", HEADER) == 1.5
