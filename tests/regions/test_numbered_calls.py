"""Calls on the region socket are numbered, so that a reply a worker wrote to the connection
itself and the service's own reply to the same call (its 504 as the deadline passed while the
worker wrote) never pass for the next call's: the real RegionServer and RegionConnection, a hook
that does what the service's does in that race."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from tests.regions.region_sockets import running
from zen_mla.regions.connection import RegionConnection
from zen_mla.regions.protocol import call_fields, encode_frame


def test_a_reply_to_an_earlier_call_is_passed_over(tmp_path):
    seen: list[Any] = []

    async def hook(
        message: dict[str, Any],
        gone: asyncio.Future[None],
        fd: int,
        uid: int | None,
        named: object,
        connection: int,
    ) -> dict | None:
        call = message["call"]
        seen.append(call)
        body = message["body"]
        if body == "worker":  # the worker wrote the reply; the service says nothing more
            os.write(fd, encode_frame({"ok": True, "call": call, "body": body}))
            return None
        if body == "race":  # the worker's reply, then the service's 504 for the same call
            os.write(fd, encode_frame({"ok": True, "call": call, "body": body}))
            return {"ok": False, "call": call, "status": 504, "error": "past its deadline"}
        return {"ok": True, "call": call, "body": body}

    with running(tmp_path, calls=hook) as r:
        client = RegionConnection(r.server.path, None, timeout=5)
        try:
            for body in ("service", "worker", "race", "after", "worker", "race", "race", "last"):
                reply = client.try_call(call_fields({"body": body}), 5)
                assert reply is not None and reply["ok"] and reply["body"] == body, reply
            assert seen == list(range(1, 9))  # numbered on this connection, from 1
            assert not client.closed
        finally:
            client.close()
