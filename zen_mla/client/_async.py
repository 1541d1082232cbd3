"""`AsyncPrefillClient`: the asyncio client, its I/O only (the rest is `BaseClient`'s)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import torch

from ..errors import SharedMemoryUnavailableError, ZenMLAError
from ..regions.client import RegionSet
from ._answers import Body, Bytes, PrefillOutput, health_json
from ._base import DEFAULT_TIMEOUT, HEALTH, BaseClient, ClientRequest, Exchange, NoRegionError
from ._deadline import Deadline
from ._resend import Resend
from ._retry import Translated
from ._transport import HeardTransport

__all__ = ["AsyncPrefillClient"]


@contextlib.asynccontextmanager
async def _async_call(deadline: Deadline) -> AsyncIterator[None]:
    """The call's task is cancelled at the deadline, whatever it awaits."""
    try:
        async with asyncio.timeout(deadline.remaining()) as scope:
            yield
    except TimeoutError as exc:
        if scope.expired() and not isinstance(exc, ZenMLAError):
            raise deadline.exceeded() from exc
        raise


async def _parts(parts: list[bytes | memoryview]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part  # type: ignore[misc]  # memoryviews go to the socket as they are


def _over_socket(pending: ClientRequest, regions: RegionSet) -> PrefillOutput | None:
    with pending.laid_out(regions) as layout:
        return pending.over_socket(regions, layout)


class AsyncPrefillClient(BaseClient):
    """asyncio client; the same arguments and behaviour as `PrefillClient` (a call past its
    timeout is cancelled, whatever transport it has)."""

    def __init__(
        self,
        url: str | Sequence[str] = "http://127.0.0.1:8000",
        *,
        token: str | None = None,
        uds: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        super().__init__(
            url, token=token, timeout=timeout, retries=retries, shared_memory=shared_memory
        )
        self._http = [
            httpx.AsyncClient(
                base_url=u, timeout=timeout, transport=transport or HeardTransport(uds)
            )
            for u in self._urls
        ]
        self._regions_lock = asyncio.Lock()  # guards self._regions

    async def regions(self, i: int = 0) -> RegionSet | None:
        """As `PrefillClient.regions`."""
        deadline = self._deadline()
        async with _async_call(deadline):
            with Translated(deadline, i):
                return await self._regions_for(i, deadline)

    async def _regions_for(
        self, i: int, deadline: Deadline, for_call: bool = False
    ) -> RegionSet | None:
        """As `PrefillClient._regions_for`."""
        if self._shared_memory is False:
            return None
        async with self._regions_lock:
            offer = self._regions.get(i)
            if offer is None or not offer.current():
                status, _, body = await self._send(i, HEALTH, deadline)
                offer = self._regions[i] = await asyncio.to_thread(self._offered, status, body)
            return offer.for_calls() if for_call else offer.regions

    async def _refused(self, i: int) -> None:
        """As `PrefillClient._refused`."""
        async with self._regions_lock:
            offer = self._regions.get(i)
            if offer is not None:
                offer.refused()

    async def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """As `PrefillClient.empty`."""
        regions = await self.regions(0)
        if regions is None:
            raise SharedMemoryUnavailableError("shared memory is off for this client")
        return await asyncio.to_thread(regions.empty, shape, dtype)

    async def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_cu_seq_lens: torch.Tensor,
        kv_cu_seq_lens: torch.Tensor | None = None,
        *,
        causal: bool = True,
        return_lse: bool = False,
        scale: float | None = None,
        kernel: str = "auto",
        request_id: str | None = None,
        out: torch.Tensor | None = None,
    ) -> PrefillOutput:
        """As `PrefillClient.prefill`."""
        pending = self._request(
            q, k, v, q_cu_seq_lens, kv_cu_seq_lens,
            causal=causal, return_lse=return_lse, scale=scale, kernel=kernel,
            request_id=request_id, out=out,
        )  # fmt: skip
        async with _async_call(pending.deadline):
            while True:
                with pending.attempt() as i:
                    return await self._attempt(i, pending)
                await asyncio.sleep(pending.wait)

    async def _attempt(self, i: int, pending: ClientRequest) -> PrefillOutput:
        regions = await self._regions_for(i, pending.deadline, for_call=True)
        if regions is not None:
            try:
                return await self._over_regions(i, pending, regions)
            except NoRegionError:
                await self._refused(i)
        status, headers, body = await self._send(i, pending.post(), pending.deadline)
        return pending.decoded(status, body, headers)

    async def _over_regions(
        self, i: int, pending: ClientRequest, regions: RegionSet
    ) -> PrefillOutput:
        if regions.client.calls:  # the whole call in one thread: copies in, the socket, out
            result = await asyncio.to_thread(_over_socket, pending, regions)
            if result is not None:
                return result
        # the copies into the region and out of it run in a thread: the event loop stays free
        stack = contextlib.ExitStack()
        layout = await asyncio.to_thread(stack.enter_context, pending.laid_out(regions))
        with stack:
            status, headers, body = await self._send(
                i, pending.region_post(layout), pending.deadline
            )
            return await asyncio.to_thread(pending.answered, status, body, headers, layout)

    async def _send(
        self, i: int, x: Exchange, deadline: Deadline
    ) -> tuple[int, httpx.Headers, Bytes]:
        """As `PrefillClient._send`, each chunk through httpx."""
        resend = Resend(deadline, idempotent=x.method == "GET")
        while True:
            with resend.send():
                status, headers, body = await self._send_once(i, x, deadline, resend)
                if not resend.again(status):
                    return status, headers, body

    async def _send_once(
        self, i: int, x: Exchange, deadline: Deadline, resend: Resend
    ) -> tuple[int, httpx.Headers, Bytes]:
        content = _parts(x.content) if isinstance(x.content, list) else x.content
        async with self._http[i].stream(
            x.method, x.path, content=content, headers=x.headers
        ) as answer:
            resend.answered()
            memory = self._answer_memory if x.tensors else None
            body = Body.of(answer.status_code, answer.headers, x.limit, deadline.check, memory)
            if body.wanted:
                async for chunk in answer.aiter_raw():
                    if not body.take(chunk):
                        break
        return answer.status_code, answer.headers, body.whole()

    async def health(self) -> dict[str, Any]:
        """As `PrefillClient.health`."""
        deadline = self._deadline()
        async with _async_call(deadline):
            with Translated(deadline, 0):
                status, _, body = await self._send(0, HEALTH, deadline)
        return health_json(status, body)

    async def aclose(self) -> None:
        for http in self._http:
            await http.aclose()
        self._close_memory()

    async def __aenter__(self) -> AsyncPrefillClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
