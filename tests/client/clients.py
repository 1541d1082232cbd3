"""How the client's tests call: each case runs both clients (CLIENTS), and a call that hangs
fails its test rather than hanging it (`bounded`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: the blocking client (PrefillClient) and the asyncio one (AsyncPrefillClient)
CLIENTS = ["sync", "async"]


def bounded(fn: Callable[[], Any], seconds: float = 20.0) -> Any:
    """fn() in a thread, failing the test (not hanging it) when it takes past `seconds`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the client still waited after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["result"]
