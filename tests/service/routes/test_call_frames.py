"""A region-socket call's frames without a server: the request frame passes the socket's one
reader, an error reply (`forms.call.refusal`) comes back as the class it left as through the
client's one translation (`_answers.called`), and an ok reply is checked like an HTTP answer."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

import zen_mla
from service.forms.call import refusal
from service.routes.calls import socket_calls
from service.settings import Settings
from service.state import ServiceState
from zen_mla.client._answers import AnswerSpec, called
from zen_mla.regions.connection import Layout
from zen_mla.regions.protocol import MAX_MESSAGE, FrameReader, encode_frame
from zen_mla.wire import regions_json as rr

ERRORS = {
    "invalid": zen_mla.InvalidInputError("k", "[Tk, H, 192]", "[3, 2, 64]", "Fix k"),
    "work_too_large": zen_mla.WorkTooLargeError("work", "<= 10", "99", "Split the batch"),
    "queue_full": zen_mla.QueueFullError("3 requests are queued", retry_after=1),
    "unavailable": zen_mla.ServiceUnavailableError("draining", retry_after=5),
    "deadline": zen_mla.DeadlineExceededError("ran past its 60 s deadline"),
    "kernel": zen_mla.KernelError("a worker died"),
    "internal": zen_mla.InternalError("internal error: KeyError: 'q'"),
    "unauthorized": zen_mla.UnauthorizedError("a valid bearer token is required"),
}


def _layout(tokens: int = 3, lse: bool = True) -> tuple[Layout, AnswerSpec]:
    q = torch.zeros(tokens, 2, 8)
    v = torch.zeros(tokens, 2, 4)
    out, lse_t = torch.arange(tokens * 8.0).view(tokens, 2, 4), torch.ones(2, tokens)
    places = {
        "out": rr.TensorPlace("h", 0, "F32", (tokens, 2, 4)),
        "lse": rr.TensorPlace("h", 4096, "F32", (2, tokens)),
    }
    if not lse:
        del places["lse"]
    layout = Layout(places, out, lse_t if lse else None)
    return layout, AnswerSpec.of({"q": q, "v": v}, lse)


def _through_the_wire(reply: dict) -> dict:
    """As the client reads it: encoded by the server, one frame read back."""
    reader = FrameReader(lambda raw: json.loads(raw))
    data = encode_frame(reply)
    got = reader.feed(data[:4])
    assert got is None
    got = reader.feed(data[4:])
    assert got is not None
    return got


@pytest.mark.parametrize("exc", ERRORS.values(), ids=ERRORS.keys())
def test_an_error_reply_raises_the_class_it_left_as(exc):
    reply = _through_the_wire(refusal(exc, "rid"))
    assert reply["ok"] is False and reply["request_id"] == "rid"
    layout, outputs = _layout()
    with pytest.raises(type(exc)) as caught:
        called(reply, layout, outputs, torch.device("cpu"))
    assert type(caught.value) is type(exc)
    if isinstance(exc, zen_mla.InvalidInputError):
        assert (caught.value.name, caught.value.expected, caught.value.got, caught.value.hint) == (
            exc.name,
            exc.expected,
            exc.got,
            exc.hint,
        )
    elif isinstance(exc, zen_mla.OverloadedError):
        assert caught.value.retry_after == exc.retry_after
    else:
        assert str(caught.value) == str(exc)


def test_a_refusal_of_the_socket_itself_is_its_status_class():
    layout, outputs = _layout()
    reply = {"ok": False, "status": 408, "error": "a frame not whole within 5 s"}
    with pytest.raises(zen_mla.RequestTimeoutError, match="not whole"):
        called(reply, layout, outputs, torch.device("cpu"))
    with pytest.raises(zen_mla.ZenMLAError):
        called({"ok": False, "status": "x"}, layout, outputs, torch.device("cpu"))


def test_an_ok_reply_is_checked_against_the_request():
    layout, outputs = _layout()
    answer = rr.encode(layout.places, {"kernel": "torch"}).decode()
    out, lse = called({"ok": True, "body": answer}, layout, outputs, torch.device("cpu"))
    assert torch.equal(out, layout.out) and torch.equal(lse, layout.lse)
    assert out.data_ptr() != layout.out.data_ptr()  # copied out of the scratch region
    moved = dict(layout.places, out=rr.TensorPlace("h", 64, "F32", (3, 2, 4)))
    bad = {
        "no body": {"ok": True},
        "not JSON": {"ok": True, "body": "{"},
        "lse missing": {"ok": True, "body": rr.encode({"out": layout.places["out"]}).decode()},
        "elsewhere": {"ok": True, "body": rr.encode(moved).decode()},
    }
    for name, reply in bad.items():
        with pytest.raises(zen_mla.ProtocolError):
            called(reply, layout, outputs, torch.device("cpu"))
        assert name


def test_a_call_frame_passes_the_one_reader_and_fits_its_cap():
    """The largest request a client sends (seven places, every option, a long request id) is a
    flat frame well under the cap."""
    place = rr.TensorPlace("A" * 64, 1 << 40, "BF16", (1 << 20, 128, 192))
    names = ("q", "k", "v", "q_cu_seq_lens", "kv_cu_seq_lens", "out", "lse")
    meta = {"causal": "false", "return_lse": "true", "scale": "0.0721", "request_id": "r" * 256}
    frame = {"op": "prefill", "body": rr.encode(dict.fromkeys(names, place), meta).decode()}
    data = encode_frame(frame)
    assert len(data) < MAX_MESSAGE // 8
    reader = FrameReader()  # the service's rules: flat, at most 16 fields
    assert reader.feed(data[:4]) is None
    assert reader.feed(data[4:]) == frame


def test_a_call_while_draining_is_a_503_with_retry_after():
    """The hook as the socket runs it, with no engine behind it: the gate's 503 and the
    metrics' socket route."""
    state = ServiceState(Settings(), draining=True)
    hook = socket_calls(state)

    async def call(frame: dict) -> dict | None:
        gone = asyncio.get_running_loop().create_future()
        return await hook(frame, gone, -1, None, None, 1)  # no descriptor: nothing is written

    reply = asyncio.run(call({"op": "prefill", "body": "{}"}))
    assert reply is not None and "call" not in reply
    assert reply["status"] == 503 and reply["retry_after"] == 5 and "draining" in reply["detail"]
    assert state.metrics.requests["socket", 503] == 1
    numbered = asyncio.run(call({"op": "prefill", "call": 12, "body": "{}"}))
    assert numbered is not None and numbered["call"] == 12 and numbered["status"] == 503
