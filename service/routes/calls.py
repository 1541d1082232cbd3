"""Prefill calls on the region socket, with no HTTP on their way: the `RegionServer`'s `calls`
hook. A call is a regions-JSON `/prefill` (`routes.regions`) in a frame, and goes through what
every compute route goes through (`exchange`: readiness, admission, the deadline, the hang-up
rule, metrics under route "socket", the log line with its timings); the token was checked by
the socket's hello.

    {"op": "prefill", "call": n, "body": "<the regions JSON request>"}
    -> {"ok": true, "call": n, "body": "<the regions JSON answer>"}
    -> {"ok": false, "call": n, "status": 4xx/5xx, "error": detail, <the problem body's
        fields>, "retry_after": seconds (429, 503)}

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
import functools
import math
import time
from typing import Any

from zen_mla import InvalidInputError, OverloadedError, ZenMLAError
from zen_mla.pool import Reply
from zen_mla.regions.protocol import encode_frame
from zen_mla.regions.server import Calls

from ..admission import client_of
from ..exchange import Exchange, compute, handle, ready_engine
from ..problems import problem_body
from ..state import ServiceState
from .regions import answer_body, resolve

__all__ = ["ROUTE", "socket_calls"]

ROUTE = "socket"  # the metrics' and the log line's name for these calls


def socket_calls(state: ServiceState) -> Calls:
    """The hook that answers the region socket's `prefill` frames for `state`."""
    return functools.partial(_call, state)


#: the largest call number: what a JSON number holds exactly
MAX_CALL = (1 << 53) - 1


async def _call(
    state: ServiceState,
    message: dict[str, Any],
    gone: asyncio.Future[None],
    fd: int,
    uid: int | None,
) -> dict[str, Any] | None:
    call = message.get("call")
    numbered = {"call": call} if type(call) is int and 0 <= call <= MAX_CALL else {}

    async def work(x: Exchange) -> dict[str, Any] | None:
        engine = ready_engine(state)
        assert state.regions is not None  # the socket runs only with its registry
        if call is not None and not numbered:
            raise InvalidInputError(
                "call", f"a whole number from 0 to {MAX_CALL} (the call's count)", f"{call!r:.40}"
            )
        body = message.get("body")
        if not isinstance(body, str):
            raise InvalidInputError(
                "body", "the regions JSON request, as a string", type(body).__name__
            )
        raw = body.encode()  # at most the frame's cap: the socket's one reader read it
        x.ticket = state.admission.admit_read(len(raw), client_of(uid))
        x.bytes_in = len(raw)
        ingest_s = time.perf_counter() - x.t0
        resolved = resolve(raw, state.regions, engine)
        x.request_id = resolved.options.request_id
        answer = answer_body(resolved, resolved.prepared.kernels, x.request_id).decode()
        reply = {"ok": True, **numbered, "body": answer}
        run = functools.partial(
            engine.run,
            resolved.prepared,
            inputs=resolved.inputs,
            outputs=resolved.outputs,
            reply=Reply(fd, encode_frame(reply)) if numbered else None,
        )
        result, (queue_s, compute_s) = await compute(state, gone, resolved.prepared, run, x)
        result.release()  # the client's memory: nothing goes back to a cache
        x.status, x.bytes_out = 200, len(answer)
        x.info |= {
            "ingest_ms": round(ingest_s * 1e3, 3),
            "queue_ms": round(queue_s * 1e3, 3),
            "compute_ms": round(compute_s * 1e3, 3),
            "replied_by": "worker" if result.replied else "service",
        }
        return None if result.replied else reply

    def answer_error(exc: ZenMLAError, x: Exchange, _: dict[str, str] | None) -> dict[str, Any]:
        return refusal(exc, x.request_id) | numbered

    return await handle(
        state, ROUTE, work, answer_error, lambda: {"ok": False, **numbered, "status": 499}
    )


def refusal(exc: ZenMLAError, request_id: str | None = None) -> dict[str, Any]:
    """The error reply: the problem body's fields, flat, and the retry hint a header carries
    on HTTP."""
    problem = problem_body(exc, request_id)
    reply: dict[str, Any] = {"ok": False, "error": problem["detail"], **problem}
    if isinstance(exc, OverloadedError) and exc.retry_after is not None:
        reply["retry_after"] = max(1, math.ceil(exc.retry_after))
    return reply
