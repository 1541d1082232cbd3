"""A request's way through the service, followed call by call (`sys.setprofile`) as
`pipeline.serve` answers one real `/prefill` (a safetensors body, the engine's worker computing
it): the pipeline hands the request to each module it needs and each returns to it. No module
calls back into one above it on the stack (in particular nothing in `zen_mla/` calls into
`service/`), and the modules it is handed to, besides the values it carries, are few."""

from __future__ import annotations

import asyncio
import sys
from types import FrameType
from typing import Any

import pytest
import torch
from starlette.requests import Request

from service.doors import HttpDoor
from service.forms.safetensors import SafetensorsForm
from service.pipeline import serve
from service.settings import Settings
from service.state import ServiceState
from zen_mla import wire
from zen_mla.engine import EngineConfig, PoolConfig, PrefillEngine

pytestmark = pytest.mark.slow

PROJECT = ("service", "zen_mla")
#: the pipeline: `serve` and its run phase
PIPELINE = ("service.pipeline", "service.compute")
#: values the request carries (their constructors and properties are no hand-off)
VALUES = {"zen_mla.deadline", "zen_mla.caller", "service.forms.base", "zen_mla.attention.batch"}
#: the most modules the pipeline hands a request to
MOST_STAYS = 10


def _body() -> bytes:
    q = torch.randn(64, 2, 192, dtype=torch.bfloat16)
    v = torch.randn(64, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    head, chunks = wire.encode({"q": q, "k": q.clone(), "v": v, "q_cu_seq_lens": cu}, {})
    return head + b"".join(bytes(c) for c in chunks)


def _modules(frame: FrameType | None) -> list[str]:
    """The project modules on the stack from `frame` out, the innermost first, each run of
    frames in one module once."""
    out: list[str] = []
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(PROJECT) and (not out or out[-1] != name):
            out.append(name)
        frame = frame.f_back
    return out


def _traced(state: ServiceState, body: bytes) -> tuple[Any, list[tuple[list[str], str]]]:
    """serve's answer to one POST /prefill of `body`, and each call into a project module from
    another: (the module stack, outermost first; the function)."""
    calls: list[tuple[list[str], str]] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not frame.f_globals.get("__name__", "").startswith(PROJECT):
            return
        stack = _modules(frame)
        if len(stack) < 2 or stack[0] != stack[1]:
            calls.append((stack[::-1], frame.f_code.co_name))

    async def main() -> Any:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # no hang-up
            raise AssertionError

        headers = [
            (b"content-type", b"application/octet-stream"),
            (b"content-length", str(len(body)).encode()),
        ]
        scope = {"type": "http", "method": "POST", "path": "/prefill", "query_string": b""}
        request = Request(scope | {"headers": headers, "client": ("127.0.0.1", 5000)}, receive)
        form = SafetensorsForm(state, "application/octet-stream")
        sys.setprofile(profile)
        try:
            return await serve(state, HttpDoor(request), form)
        finally:
            sys.setprofile(None)

    return asyncio.run(main()), calls


@pytest.fixture(scope="module")
def state():
    engine = PrefillEngine(EngineConfig(PoolConfig(workers=1)))
    engine.start()
    try:
        yield ServiceState(Settings(), engine=engine, ready=True)
    finally:
        engine.close()


def test_a_request_goes_down_and_back_never_up(state):
    answer, calls = _traced(state, _body())
    assert answer.status_code == 200
    within = [(stack, name) for stack, name in calls if "service.pipeline" in stack]
    assert len(within) > 20, "the trace saw the request's calls"
    up = [f"{' > '.join(stack)}: {name}" for stack, name in within if stack[-1] in stack[:-2]]
    assert not up, "\n".join(up)
    from_library = [
        f"{' > '.join(stack)}: {name}"
        for stack, name in within
        if stack[-1].startswith("service") and any(m.startswith("zen_mla") for m in stack)
    ]
    assert not from_library, "\n".join(from_library)


def test_the_pipeline_hands_a_request_to_few_modules(state):
    answer, calls = _traced(state, _body())
    assert answer.status_code == 200
    stays = {
        stack[-1]
        for stack, _ in calls
        if len(stack) >= 2 and stack[-2] in PIPELINE and stack[-1] not in PIPELINE
    }
    assert {"service.body", "service.admission", "zen_mla.engine"} <= stays  # what it saw
    handed = sorted(stays - VALUES)
    assert len(handed) <= MOST_STAYS, handed
