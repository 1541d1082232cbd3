"""`AsyncPrefillClient`: the asyncio client, its I/O only (the rest is `BaseClient`'s)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import torch

from ..envs import DEFAULT_URL
from ..errors import SharedMemoryUnavailableError, ZenMLAError
from ..regions.connection import RegionSet
from ._answers import Body, Bytes, PrefillOutput, health_json
from ._base import (
    DEFAULT_TIMEOUT,
    HEALTH,
    PROBE_TIMEOUT,
    READY,
    BaseClient,
    ClientRequest,
    Exchange,
    NoRegionError,
)
from ._deadline import Deadline
from ._endpoints import Endpoint
from ._latent import registered
from ._names import FIRST_WAIT
from ._resend import Resend
from ._retry import Translated
from ._transport import HeardTransport, call_deadline

__all__ = ["AsyncPrefillClient"]


@contextlib.asynccontextmanager
async def _async_call(deadline: Deadline) -> AsyncIterator[None]:
    """The call's task is cancelled at the deadline, whatever it awaits; its connects take their
    share of what it has left (`call_deadline`)."""
    try:
        async with asyncio.timeout(deadline.remaining()) as scope:
            with call_deadline(deadline):
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


class AsyncPrefillClient(BaseClient[httpx.AsyncClient]):
    """asyncio client; the same arguments and behaviour as `PrefillClient` (a call past its
    timeout is cancelled, whatever transport it has)."""

    def __init__(
        self,
        url: str | Sequence[str] = DEFAULT_URL,
        *,
        token: str | None = None,
        uds: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
        shared_memory: bool | None = None,
        resolve_every: float = 5.0,
    ) -> None:
        self._timeout, self._transport, self._uds = timeout, transport, uds
        # made once (~30 ms: the CA bundle read), shared by every endpoint's transport
        self._ssl_context = None if transport else httpx.create_ssl_context()
        super().__init__(
            url, token=token, timeout=timeout, retries=retries, shared_memory=shared_memory,
            uds=uds, resolve_every=resolve_every,
        )  # fmt: skip
        self._probes: set[asyncio.Task[None]] = set()

    def _connect(self, url: httpx.URL, headers: dict[str, str]) -> httpx.AsyncClient:
        transport = self._transport or HeardTransport(self._uds, self._ssl_context)
        return httpx.AsyncClient(
            base_url=url, headers=headers, timeout=self._timeout, transport=transport
        )

    def _asking(self) -> asyncio.Lock:
        return asyncio.Lock()

    def _launch_probe(self, ep: Endpoint[httpx.AsyncClient]) -> None:
        task = asyncio.get_running_loop().create_task(self._probe(ep))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, ep: Endpoint[httpx.AsyncClient]) -> None:
        """As `PrefillClient._probe`."""
        deadline = Deadline(min(PROBE_TIMEOUT, self._budget or PROBE_TIMEOUT))
        ready = False
        self._balancer.begin(ep, 0)
        try:
            # its own deadline: the task was made in a call's context, with the call's
            async with asyncio.timeout(deadline.remaining()):
                with call_deadline(deadline):
                    status = (await self._send(ep, READY, deadline))[0]
                    if status == 404:  # a service older than /health/ready
                        status = (await self._send(ep, HEALTH, deadline))[0]
            ready = status == 200
        except Exception:  # unreachable, closed meanwhile, timed out: not ready
            pass
        finally:
            self._balancer.end(ep, 0)
            self._balancer.probed(ep, ready)

    async def _refresh(self, deadline: Deadline) -> None:
        """As `PrefillClient._refresh`."""
        pending = self._lookups.due()
        if pending is not None and self._lookups.first:
            left = deadline.remaining()
            wait = FIRST_WAIT if left is None else max(0.0, min(FIRST_WAIT, left))
            await asyncio.wait({asyncio.wrap_future(pending)}, timeout=wait)
        self._take_lookup()
        for ep in self._balancer.idle():
            self._retire(ep)
            if self._transport is None:  # a transport of the caller's serves every endpoint
                await ep.http.aclose()

    @contextlib.asynccontextmanager
    async def _on(self, i: int, deadline: Deadline) -> AsyncIterator[Endpoint[httpx.AsyncClient]]:
        """As `PrefillClient._on`."""
        await self._refresh(deadline)
        ep = self._balancer.at(i)
        self._balancer.begin(ep, 0)
        try:
            with Translated(deadline, ep):
                yield ep
        finally:
            self._balancer.end(ep, 0)

    async def regions(self, i: int = 0) -> RegionSet | None:
        """As `PrefillClient.regions`."""
        deadline = self._deadline()
        async with _async_call(deadline), self._on(i, deadline) as ep:
            return await self._regions_for(ep, deadline)

    async def _regions_for(
        self, ep: Endpoint[httpx.AsyncClient], deadline: Deadline, for_call: bool = False
    ) -> RegionSet | None:
        """As `PrefillClient._regions_for`."""
        if self._shared_memory is False:
            return None
        async with ep.asking:
            offer = ep.offer
            if offer is None or not offer.current():
                status, _, body = await self._send(ep, HEALTH, deadline)
                offer = ep.offer = await asyncio.to_thread(self._offered, status, body)
            return offer.for_calls() if for_call else offer.regions

    async def _refused(self, ep: Endpoint[httpx.AsyncClient]) -> None:
        """As `PrefillClient._refused`."""
        async with ep.asking:
            if ep.offer is not None:
                ep.offer.refused()

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
        return await self._call(pending)

    def register_weight(self, name: str, w_kv_b: torch.Tensor) -> None:
        """As `PrefillClient.register_weight` (nothing is sent until a call needs it)."""
        self._weights.add(name, w_kv_b)

    async def forget_weight(self, name: str) -> None:
        """As `PrefillClient.forget_weight`."""
        deadline = self._deadline()
        async with _async_call(deadline):
            for ep in await asyncio.to_thread(self._forgotten_by, name):
                await self._send(ep, self._weight_delete(name), deadline)

    async def prefill_latent(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        weight: str,
        q_cu_seq_lens: torch.Tensor,
        kv_cu_seq_lens: torch.Tensor | None = None,
        *,
        causal: bool = True,
        return_lse: bool = False,
        scale: float | None = None,
        form: str = "auto",
        precision: str = "auto",
        request_id: str | None = None,
    ) -> PrefillOutput:
        """As `PrefillClient.prefill_latent`."""
        pending = self._latent_request(
            q, kv_c, k_pe, weight, q_cu_seq_lens, kv_cu_seq_lens,
            causal=causal, return_lse=return_lse, scale=scale, form=form, precision=precision,
            request_id=request_id,
        )  # fmt: skip
        return await self._call(pending)

    async def _call(self, pending: ClientRequest) -> PrefillOutput:
        """As `PrefillClient._call`."""
        async with _async_call(pending.deadline):
            await self._refresh(pending.deadline)
            while True:
                with pending.attempt() as ep:
                    return await self._attempt(ep, pending)
                await asyncio.sleep(pending.wait)

    async def _latent_attempt(
        self, ep: Endpoint[httpx.AsyncClient], pending: ClientRequest
    ) -> PrefillOutput:
        """As `PrefillClient._latent_attempt`."""
        regions = await self._regions_for(ep, pending.deadline, for_call=True)
        if regions is not None and regions.connection.calls:
            try:
                result = await asyncio.to_thread(pending.latent_over_socket, regions, ep)
                if result is not None:
                    return result
            except NoRegionError:
                await self._refused(ep)
        name, weights = pending.weight, self._weights
        assert name is not None
        for again in (False, True):
            if not weights.held(ep, name):
                put = self._weight_put(name)
                status, headers, body = await self._send(ep, put, pending.deadline)
                registered(status, body, headers)
                weights.mark(ep, name, True)
            status, headers, body = await self._send(ep, pending.post(), pending.deadline)
            if status != 404 or again:
                break
            weights.mark(ep, name, False)
        return pending.decoded(status, body, headers)

    async def _attempt(
        self, ep: Endpoint[httpx.AsyncClient], pending: ClientRequest
    ) -> PrefillOutput:
        if pending.weight is not None:
            return await self._latent_attempt(ep, pending)
        regions = await self._regions_for(ep, pending.deadline, for_call=True)
        if regions is not None:
            try:
                return await self._over_regions(ep, pending, regions)
            except NoRegionError:
                await self._refused(ep)
        status, headers, body = await self._send(ep, pending.post(), pending.deadline)
        return pending.decoded(status, body, headers)

    async def _over_regions(
        self, ep: Endpoint[httpx.AsyncClient], pending: ClientRequest, regions: RegionSet
    ) -> PrefillOutput:
        if regions.connection.calls:  # the whole call in one thread: copies in, the socket, out
            result = await asyncio.to_thread(_over_socket, pending, regions)
            if result is not None:
                return result
        # the copies into the region and out of it run in a thread: the event loop stays free
        stack = contextlib.ExitStack()
        layout = await asyncio.to_thread(stack.enter_context, pending.laid_out(regions))
        with stack:
            status, headers, body = await self._send(
                ep, pending.region_post(layout), pending.deadline
            )
            return await asyncio.to_thread(pending.answered, status, body, headers, layout)

    async def _send(
        self, ep: Endpoint[httpx.AsyncClient], x: Exchange, deadline: Deadline
    ) -> tuple[int, httpx.Headers, Bytes]:
        """As `PrefillClient._send`, each chunk through httpx."""
        resend = Resend(deadline, idempotent=x.method == "GET")
        while True:
            with resend.send():
                status, headers, body = await self._send_once(ep, x, deadline, resend)
                if not resend.again(status):
                    return status, headers, body

    async def _send_once(
        self, ep: Endpoint[httpx.AsyncClient], x: Exchange, deadline: Deadline, resend: Resend
    ) -> tuple[int, httpx.Headers, Bytes]:
        content = _parts(x.content) if isinstance(x.content, list) else x.content
        async with ep.http.stream(
            x.method,
            x.path,
            content=content,
            headers=x.headers_within(deadline),
            extensions=ep.extensions,
        ) as answer:
            resend.answered()
            memory = self._answer_memory if x.tensors else None
            body = Body.of(answer.status_code, answer.headers, x.limit, deadline.check, memory)
            if body.wanted:
                async for chunk in answer.aiter_raw():
                    if not body.take(chunk):
                        break
        return answer.status_code, answer.headers, body.whole()

    async def health(self, i: int = 0) -> dict[str, Any]:
        """As `PrefillClient.health`."""
        deadline = self._deadline()
        async with _async_call(deadline), self._on(i, deadline) as ep:
            status, _, body = await self._send(ep, HEALTH, deadline)
        return health_json(status, body)

    async def aclose(self) -> None:
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        for ep in self._close_all():
            await ep.http.aclose()

    async def __aenter__(self) -> AsyncPrefillClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
