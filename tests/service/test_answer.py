"""A response's shared memory goes back to the pool only when the transport is done with it.

uvloop keeps (by reference) the chunks it could not write at once and sends them after the app
has handed over the last one; reusing the memory at that point sent another request's numbers
(seen under load: bench/load.py counted 2-5 wrong answers in 20 s before this was fixed). A
small answer is copied into one plain response, and its memory is back at once."""

from __future__ import annotations

import asyncio
import gc

import torch
from starlette.responses import Response

from service.answer import Streamed
from service.forms.safetensors import send
from zen_mla.attention import KernelChoice
from zen_mla.engine import PrefillResult
from zen_mla.pool import PoolResult
from zen_mla.pool._shm import BufferCache, SharedBuffer


def sent(
    cache: BufferCache, nbytes: int, shape: tuple[int, int, int]
) -> tuple[SharedBuffer, torch.Tensor, Response]:
    """A buffer of `nbytes` from `cache`, a random bf16 `out` of `shape` in it, and the answer
    `send` makes of it."""
    buf = cache.get(nbytes)
    out = buf.tensor(0, shape, torch.bfloat16)
    out.copy_(torch.randn(*shape))
    pool_result = PoolResult(out, None, "torch", buf, cache)
    response = send(PrefillResult(out, None, KernelChoice("torch", None), pool_result), None)
    return buf, out, response


def test_memory_returns_only_after_the_last_chunk_is_dropped():
    cache = BufferCache(1 << 30)
    buf, _, response = sent(cache, 8 << 20, (4096, 8, 128))
    assert isinstance(response, Streamed)

    async def drain() -> list[object]:
        held: list[object] = []

        async def keep(message: object) -> None:
            held.append(message)

        async def nothing() -> dict[str, str]:
            return {"type": "http.disconnect"}

        await response({"type": "http"}, nothing, keep)
        return held

    held = asyncio.run(drain())  # the app has handed over every chunk; a transport holds them
    gc.collect()
    assert cache.get(8 << 20) is not buf, "reused while a transport still holds its bytes"
    del held
    gc.collect()
    assert cache.get(8 << 20) is buf, "returned once nothing refers to it"


def test_a_small_answer_is_one_response_and_its_memory_returns_at_once():
    cache = BufferCache(1 << 30)
    buf, out, response = sent(cache, 64 << 10, (8, 16, 128))
    assert not isinstance(response, Streamed)
    assert cache.get(64 << 10) is buf, "a small answer's memory is copied out and released"
    header = int.from_bytes(response.body[:8], "little")
    assert response.body[8 + header :] == out.view(torch.uint8).numpy().tobytes()
    assert int(response.headers["content-length"]) == len(response.body)
