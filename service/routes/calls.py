"""Prefill calls on the region socket, with no HTTP on their way: the `RegionServer`'s `calls`
hook. A call is a prefill frame (`forms.call`) come in by the socket's door (`doors.CallDoor`),
and goes through the one pipeline as any request (`pipeline.serve`)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from zen_mla.caller import Caller
from zen_mla.regions import Calls

from ..doors import CallDoor
from ..forms.call import CallForm, Frame
from ..pipeline import serve
from ..state import ServiceState

__all__ = ["socket_calls"]


def socket_calls(state: ServiceState) -> Calls:
    """The hook that answers the region socket's `prefill` frames for `state`."""
    return functools.partial(_call, state)


async def _call(
    state: ServiceState,
    message: dict[str, Any],
    gone: asyncio.Future[None],
    fd: int,
    uid: int | None,
    tenant: Caller | None,
) -> Frame | None:
    form = CallForm(state.regions, message.get("call"), fd)
    return await serve(state, CallDoor(message, gone, uid, tenant), form)
