"""How the client's tests call: each case runs both clients (CLIENTS), each as a blocking call
of its prefill (`calling`), and a call that hangs fails its test rather than hanging it
(`bounded`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from zen_mla.client import AsyncPrefillClient, PrefillClient

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


@contextmanager
def calling(kind: str, url: str | list[str], **options: Any) -> Iterator[tuple[Any, Callable]]:
    """(the client, a blocking call of its prefill): the asyncio client's calls run on a loop
    of their own, in a thread, as long as the block."""
    if kind == "sync":
        with PrefillClient(url, **options) as client:
            yield client, client.prefill
        return
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    aclient = AsyncPrefillClient(url, **options)

    def call(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(aclient.prefill(*args, **kwargs), loop).result()

    try:
        yield aclient, call
    finally:
        asyncio.run_coroutine_threadsafe(aclient.aclose(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
