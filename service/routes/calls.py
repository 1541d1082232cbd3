"""Calls on the region socket, with no HTTP on their way: the `RegionServer`'s `calls` hook. A
prefill frame, or a weight registered from a region (`forms.call`), comes in by the socket's
door (`doors.CallDoor`) and goes through the one pipeline as any request (`pipeline.serve`); a
weight is forgotten as `DELETE /weights/{name}` forgets it, for the socket's caller. A weight
registered on a connection ends with it, as its regions do (`socket_ended`)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from zen_mla import ZenMLAError, wire
from zen_mla.caller import Caller
from zen_mla.regions import Calls, Ended

from ..doors import CallDoor
from ..forms.call import CallForm, Frame, WeightCallForm, check_call, numbered, refusal
from ..forms.weight import weights_of
from ..pipeline import serve
from ..state import ServiceState

__all__ = ["socket_calls", "socket_ended"]


def socket_calls(state: ServiceState) -> Calls:
    """The hook that answers the region socket's frames of `CALL_OPS` for `state`."""
    return functools.partial(_call, state)


def socket_ended(state: ServiceState) -> Ended:
    """The hook told that a region-socket connection ended: its weights are forgotten."""

    def ended(connection: int) -> None:
        if state.weights is not None:
            state.weights.end(connection)

    return ended


async def _call(
    state: ServiceState,
    message: dict[str, Any],
    gone: asyncio.Future[None],
    fd: int,
    uid: int | None,
    tenant: Caller | None,
    connection: int,
) -> Frame | None:
    door = CallDoor(message, gone, uid, tenant)
    call = message.get("call")
    op = message.get("op")
    if op == "weight":
        form = WeightCallForm(state, message.get("name"), call, connection, gone)
        return await serve(state, door, form)
    if op == "forget":
        return _forget(state, door, message.get("name"), call)
    return await serve(state, door, CallForm(state, call, fd))


def _forget(state: ServiceState, door: CallDoor, name: object, call: object) -> Frame:
    """The socket's caller's weight `name` forgotten (`DELETE /weights/{name}`'s rule)."""
    reply = numbered(call)
    try:
        check_call(call, reply)
        weights_of(state).forget(door.caller, wire.check_weight_name("name", name))
    except ZenMLAError as exc:
        return refusal(exc) | reply
    return {"ok": True, **reply}
