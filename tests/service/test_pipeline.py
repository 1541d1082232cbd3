"""`pipeline.serve` with forms made here to misbehave: whatever a form does, the pipeline
answers in the form's shape, gives back what the request held, and counts it. A bug of the
service is a 500 of its own class (InternalError), which a client raises as such; a request's
id reaches its error once the form knows it. The door is a real region-socket frame
(`CallDoor`), the engine real (never started: nothing here runs)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

import zen_mla
from service.doors import CallDoor, Door
from service.forms.base import Expect, Form, RequestRecord, Work
from service.pipeline import serve
from service.problems import problem_body
from service.settings import Settings
from service.state import ServiceState
from zen_mla.client._answers import problem
from zen_mla.engine import EngineConfig, PoolConfig, PrefillEngine, SharedBuffer


@pytest.fixture(scope="module")
def engine():
    return PrefillEngine(EngineConfig(PoolConfig(workers=1)))  # buffers only: never started


class Failing(Form[dict[str, Any]]):
    """Reads a frame's body, then fails with `error` as it decodes it."""

    route = "socket"

    def __init__(self, error: BaseException, request_id: str | None = None) -> None:
        self.error = error
        self.request_id = request_id

    def expect(self, settings: Settings, door: Door) -> Expect:
        return Expect(1 << 10, small=True)

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> Work:
        record.request_id = self.request_id
        raise self.error

    def refuse(self, exc: zen_mla.ZenMLAError, record: RequestRecord, headers: dict[str, str]):
        return {"error": exc, "status": record.status, "request_id": record.request_id}

    def hung_up(self) -> dict[str, Any]:
        return {"hung_up": True}


def _serve(
    engine: PrefillEngine, form: Form[dict[str, Any]]
) -> tuple[dict[str, Any], ServiceState]:
    state = ServiceState(Settings(), engine=engine, ready=True)

    async def main() -> dict[str, Any]:
        gone = asyncio.get_running_loop().create_future()
        return await serve(state, CallDoor({"op": "prefill", "body": "{}"}, gone, 1000), form)

    return asyncio.run(main()), state


def test_a_bug_of_the_service_is_a_500_internal_error_and_nothing_stays_held(engine):
    answer, state = _serve(engine, Failing(KeyError("q"), request_id="r-1"))
    error = answer["error"]
    assert type(error) is zen_mla.InternalError  # not KernelError: the kernel did nothing
    assert "KeyError" in str(error)
    assert answer["status"] == 500 and answer["request_id"] == "r-1"
    assert zen_mla.status_of(error) == 500
    assert state.metrics.requests["socket", 500] == 1
    assert state.admission.inflight == 0  # its admission given back


def test_a_zen_mla_error_is_answered_as_itself(engine):
    raised = zen_mla.InvalidInputError("q", "[Tq, H, Dqk]", "[3]")
    answer, state = _serve(engine, Failing(raised))
    assert answer["error"] is raised and answer["status"] == 422
    assert state.metrics.requests["socket", 422] == 1 and state.admission.inflight == 0


def test_a_body_over_the_form_s_limit_is_refused_before_it_is_admitted(engine):
    form = Failing(AssertionError("never decoded"))
    form.expect = lambda settings, door: Expect(1, small=True)  # type: ignore[method-assign]
    answer, state = _serve(engine, form)
    assert type(answer["error"]) is zen_mla.BodyTooLargeError and answer["status"] == 413
    assert state.admission.inflight == 0


def test_the_client_raises_a_service_bug_as_internal_error():
    body = problem_body(zen_mla.InternalError("internal error: KeyError: 'q'"), "r-2")
    assert body["status"] == 500
    raised = problem(500, json.dumps(body).encode(), httpx.Headers())
    assert type(raised) is zen_mla.InternalError and "KeyError" in str(raised)
