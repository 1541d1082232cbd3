"""The one readiness (no server): what /health, the /v2 readiness routes and the compute routes'
gate are told, in each phase of the service's life."""

from __future__ import annotations

from typing import Any

import pytest

from service.settings import Settings
from service.state import ServiceState, readiness
from zen_mla import ServiceUnavailableError


class Workers:
    """An engine as readiness sees it: its workers, and how often they were asked."""

    def __init__(self, *alive: bool) -> None:
        self.alive, self.asked = alive, 0

    def workers(self) -> list[dict[str, Any]]:
        self.asked += 1
        return [{"id": i, "alive": a} for i, a in enumerate(self.alive)]


def state_with(engine: Workers | None, **fields: Any) -> ServiceState:
    return ServiceState(Settings(), engine=engine, **fields)  # type: ignore[arg-type]


PHASES = {
    # (engine's workers alive, state fields): status, ready, admitting, the 503's message
    "starting": ((), {}, "starting", False, False, "the worker pool is starting"),
    "failed": ((), {"start_error": "OSError: no"}, "failed", False, False, "OSError: no"),
    "draining": ((True,), {"ready": True, "draining": True}, "draining", False, False, "draining"),
    "ok": ((True, True), {"ready": True}, "ok", True, True, None),
    "degraded": ((True, False), {"ready": True}, "degraded", True, True, None),
    "no_worker": ((False,), {"ready": True}, "no_worker", False, True, "no worker is alive"),
}


@pytest.mark.parametrize("case", PHASES.values(), ids=PHASES.keys())
def test_each_phase_says_whether_and_why_not(case):
    alive, fields, status, ready, admitting, message = case
    now = readiness(state_with(Workers(*alive) if alive else None, **fields))
    assert (now.status, now.ready, now.admitting) == (status, ready, admitting)
    if message is not None:
        error = now.error(retry_after=5)
        assert isinstance(error, ServiceUnavailableError) and message in str(error)
        assert error.retry_after == 5


def test_the_gate_does_not_ask_the_workers():
    engine = Workers(True)
    now = readiness(state_with(engine, ready=True))
    assert now.admitting and engine.asked == 0
    assert now.ready and now.workers == [{"id": 0, "alive": True}] and engine.asked == 1
