"""A prefill call on the region socket (`CallForm`), with no HTTP on its way, taken by the
`RegionServer`'s `calls` hook (`routes.calls`). A call is a regions-JSON `/prefill`
(`forms.regions`) in a frame, come in by the socket's door (`doors.CallDoor`), and goes
through the one pipeline as any request (`pipeline.serve`: readiness, admission, the deadline,
the hang-up rule, metrics under route "socket", the log line with its timings); the token was
checked by the socket's hello.

    {"op": "prefill", "call": n, "body": "<the regions JSON request>"}
    -> {"ok": true, "call": n, "body": "<the regions JSON answer>"}
    -> {"ok": false, "call": n, "status": 4xx/5xx, "error": detail, <the problem body's
        fields>, "retry_after": seconds (429, 503)}

A `weight` frame registers the weight where it lies in one of the caller's regions (a regions
JSON body `{"w_kv_b": place}`, `forms.weight`: copied into the service's memory, charged to
the caller), answered with the entry `GET /weights` lists, as a JSON string:

    {"op": "weight", "name": "<name>", "call": n, "body": "<the regions JSON>"}
    -> {"ok": true, "call": n, "body": "{\"name\": ..., \"shape\": ..., \"dtype\": ...,
        \"bytes\": ...}"}

The error reply carries what a problem+json does (`problems.problem_body`: type, detail, tensor,
expected, got, hint), so the client raises the class the service raised, through its one table.

`call`, the client's count of its calls on the connection, is optional. With it, a call run on
one worker straight from the event loop is answered by that worker: the reply (known before the
work runs: where the results go) rides with the task with the connection's descriptor, and the
worker writes it the moment the kernel is done, with no hop back through this process (one
wake-up and the completion's Python off each call). Should the deadline pass as it does, the
service's 504 and the worker's reply both come, numbered: the client keeps the first.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from zen_mla import InvalidInputError, OverloadedError, ZenMLAError
from zen_mla.engine import PrefillRequest, Reply
from zen_mla.regions import encode_frame
from zen_mla.wire import regions_json

from ..doors import Door
from ..held import Held
from ..problems import problem_body
from ..settings import Settings
from ..state import ServiceState
from .base import ClientGoneError, Computed, Expect, Form, RequestRecord
from .regions import RegionsRequest
from .weight import WeightRequest

__all__ = [
    "MAX_CALL",
    "ROUTE",
    "CallForm",
    "Frame",
    "WeightCallForm",
    "check_call",
    "numbered",
    "refusal",
]

ROUTE = "socket"  # the metrics' and the log line's name for these calls

#: the largest call number: what a JSON number holds exactly
MAX_CALL = (1 << 53) - 1

Frame = dict[str, Any]


class CallForm(RegionsRequest, Form["Frame | None"]):
    """A prefill frame: a regions JSON request, answered by a frame (None where the worker wrote
    it). `call` is the client's count of its calls on the connection (optional); `fd` the
    connection's descriptor, which a worker's reply is written to."""

    route = ROUTE

    def __init__(self, state: ServiceState, call: object, fd: int) -> None:
        super().__init__(state.regions, state)
        self.call = call
        self.fd = fd
        self.numbered = numbered(call)
        self.frame: Frame = {}

    def expect(self, settings: Settings, door: Door) -> Expect:
        check_call(self.call, self.numbered)
        return super().expect(settings, door)

    def reply(self, prepared: PrefillRequest) -> Reply | None:
        # known before the work runs (where the results go): a worker may write it itself
        body = self.answer_body(prepared.kernels, self._request_id()).decode()
        self.frame = {"ok": True, **self.numbered, "body": body}
        return Reply(self.fd, encode_frame(self.frame)) if self.numbered else None

    async def answer(self, result: Computed | None, record: RequestRecord) -> Frame | None:
        assert result is not None
        record.bytes_out = len(self.frame["body"])
        record.info["replied_by"] = "worker" if result.replied else "service"
        return None if result.replied else self.frame

    def refuse(self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]) -> Frame:
        return refusal(exc, record.request_id) | self.numbered

    def hung_up(self) -> Frame:
        return {"ok": False, **self.numbered, "status": 499}

    def _request_id(self) -> str | None:
        return self.resolved.options.request_id if self.resolved is not None else None


class WeightCallForm(WeightRequest, Form["Frame"]):
    """A `weight` frame: a weight registered from the caller's region, answered by its entry;
    it ends with the connection (`Weights.end`)."""

    def __init__(
        self,
        state: ServiceState,
        name: object,
        call: object,
        connection: int,
        gone: asyncio.Future[None],
    ) -> None:
        super().__init__(state, regions_json.MEDIA_TYPE, name if isinstance(name, str) else "")
        self.connection = connection  # the weight ends with it
        self.gone = gone  # resolved once it has ended
        self.given = name
        self.call = call
        self.numbered = numbered(call)

    def expect(self, settings: Settings, door: Door) -> Expect:
        check_call(self.call, self.numbered)
        if not isinstance(self.given, str):
            raise InvalidInputError(
                "name", "the weight's name, a string", type(self.given).__name__
            )
        return super().expect(settings, door)

    def keep(self, held: Held) -> None:
        # a connection that ended before its frame was taken up has had its weights forgotten:
        # one kept now would outlive it
        if self.gone.done():
            raise ClientGoneError("the region socket's connection ended")
        super().keep(held)

    async def answer(self, result: Computed | None, record: RequestRecord) -> Frame:
        assert self.weight is not None
        return {"ok": True, **self.numbered, "body": json.dumps(self.weight.entry())}

    def refuse(self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]) -> Frame:
        return refusal(exc) | self.numbered

    def hung_up(self) -> Frame:
        return {"ok": False, **self.numbered, "status": 499}


def numbered(call: object) -> Frame:
    """The reply's `call` field: the frame's own, where it is a call's count."""
    return {"call": call} if type(call) is int and 0 <= call <= MAX_CALL else {}


def check_call(call: object, numbered: Frame) -> None:
    """A `call` given is a call's count (InvalidInputError naming it otherwise)."""
    if call is not None and not numbered:
        raise InvalidInputError(
            "call", f"a whole number from 0 to {MAX_CALL} (the call's count)", f"{call!r:.40}"
        )


def refusal(exc: ZenMLAError, request_id: str | None = None) -> Frame:
    """The error reply: the problem body's fields, flat, and the retry hint a header carries
    on HTTP."""
    problem = problem_body(exc, request_id)
    reply: Frame = {"ok": False, "error": problem["detail"], **problem}
    if isinstance(exc, OverloadedError) and exc.retry_after is not None:
        reply["retry_after"] = max(1, math.ceil(exc.retry_after))
    return reply
