"""Clients of the zen-mla service, on httpx: `PrefillClient` and `AsyncPrefillClient`.

    with PrefillClient("http://127.0.0.1:8000") as client:
        out, lse = client.prefill(q, k, v, q_cu_seq_lens, return_lse=True)

`prefill` takes and returns what `zen_mla.ragged_attention` does; tensors on another device
(CUDA) go over as CPU tensors and come back on the caller's device. Errors arrive as the same
zen_mla exceptions the service raised; 429 and 503 are retried after `Retry-After`, a few times.

Given several endpoints (`PrefillClient(["http://a:8000", "http://b:8000"])`), each request goes
to the one with the least outstanding work (attention pairs in flight); an unreachable or
overloaded endpoint is passed over for another.

On the service's host, tensors need not cross a socket: with `shared_memory=None` (the default)
the client uses same-host regions wherever the service offers them and their socket can be
reached from here, `True` requires them, `False` never uses them. A request's tensors are then
copied once into a region the client holds (or not at all, for tensors made with `empty()`),
and the workers read them and write the results there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import torch

from . import _errors, region_request, wire
from ._errors import (
    BY_STATUS,
    DeadlineExceededError,
    InvalidInputError,
    OverloadedError,
    ServiceUnavailableError,
    SharedMemoryUnavailableError,
    ZenMLAError,
)
from ._ragged import visible_pairs
from ._shm_client import Layout, RegionClient, RegionSet

__all__ = ["AsyncPrefillClient", "PrefillClient"]

DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=600.0, pool=600.0)
# httpcore sends a body part with `while buf: n = sock.send(buf); buf = buf[n:]` after h11 joins
# it into bytes: one huge part costs quadratic copying (measured: 0.1 GB/s at 256 MiB). Parts of
# this size keep it to about one copy.
SEND_PART = 256 << 10
MAX_RETRY_WAIT = 30.0
DOWN_FOR = 5.0  # seconds an unreachable endpoint is passed over

PrefillResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _request(
    tensors: dict[str, torch.Tensor], meta: dict[str, str]
) -> tuple[torch.device, list[bytes | memoryview], int]:
    """A safetensors body of checked tensors (`_tensors`) and options metadata, in parts."""
    device = tensors["q"].device
    header, chunks = wire.encode({n: t.detach().cpu() for n, t in tensors.items()}, meta)
    parts: list[bytes | memoryview] = [header]
    for chunk in chunks:
        parts.extend(chunk[i : i + SEND_PART] for i in range(0, chunk.nbytes, SEND_PART))
    return device, parts, sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


def _headers(token: str | None, length: int) -> dict[str, str]:
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(length)}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _error(status: int, body: bytes, headers: httpx.Headers) -> ZenMLAError:
    """The exception the service raised, from its problem+json (one table: `_errors`)."""
    try:
        import json

        problem = json.loads(body)
        assert isinstance(problem, dict)
    except Exception:
        problem = {"detail": body[:200].decode("utf-8", "replace")}
    name = str(problem.get("type", "")).rpartition(":")[2]
    cls = getattr(_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ZenMLAError)):
        cls = BY_STATUS.get(status, ZenMLAError)
    detail = str(problem.get("detail", f"HTTP {status}"))
    if issubclass(cls, InvalidInputError):
        return cls(
            str(problem.get("tensor") or "body"),
            str(problem.get("expected") or "a valid request"),
            str(problem.get("got") or detail),
        )
    if issubclass(cls, OverloadedError):
        retry = headers.get("retry-after")
        return cls(detail, float(retry) if retry and retry.isdigit() else None)
    return cls(detail)


def _decode(buf: bytearray, device: torch.device, return_lse: bool) -> PrefillResult:
    tensors, _meta = wire.decode(torch.frombuffer(buf, dtype=torch.uint8), wire.RESPONSE_TENSORS)
    out = tensors["out"].to(device)
    if return_lse:
        return out, tensors["lse"].to(device)
    return out


def _retry_wait(exc: OverloadedError, attempt: int) -> float:
    return min(exc.retry_after if exc.retry_after is not None else 0.5 * 2**attempt, MAX_RETRY_WAIT)


def _work(q: torch.Tensor, q_cu: torch.Tensor, kv_cu: torch.Tensor | None, causal: bool) -> int:
    """The request's weight for balancing: heads x visible (query, key) pairs."""
    qc = q_cu.tolist()
    kc = kv_cu.tolist() if kv_cu is not None else qc
    pairs = sum(
        visible_pairs(qc[r + 1] - qc[r], kc[r + 1] - kc[r], causal) for r in range(len(qc) - 1)
    )
    return int(q.shape[1]) * pairs if q.ndim == 3 else pairs


def _regions_of(health: dict[str, Any], token: str | None, required: bool) -> RegionSet | None:
    """The same-host regions of the service whose /health this is, or None where they cannot
    be had (SharedMemoryUnavailableError instead when `required`). The region socket must
    answer with the instance /health names: a path that exists here may belong to another
    service than the one at this URL."""
    offer = health.get("shared_memory")
    try:
        if not isinstance(offer, dict) or not offer.get("socket"):
            raise SharedMemoryUnavailableError("the service offers no shared memory")
        client = RegionClient(str(offer["socket"]), token)
        if client.hello.get("instance") != offer.get("instance"):
            client.close()
            raise SharedMemoryUnavailableError(
                f"the region socket {offer['socket']} belongs to another service (not this host's?)"
            )
    except SharedMemoryUnavailableError:
        if required:
            raise
        return None
    return RegionSet(client)


def _region_headers(token: str | None) -> dict[str, str]:
    headers = {"Content-Type": region_request.MEDIA_TYPE}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _tensors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    tensors = {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu_seq_lens}
    if kv_cu_seq_lens is not None:
        tensors["kv_cu_seq_lens"] = kv_cu_seq_lens
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(name, "a torch.Tensor", type(t).__name__)
        if name in ("q", "k", "v") and t.ndim != 3:
            raise InvalidInputError(name, "a 3-D tensor [T, H, D]", f"shape {tuple(t.shape)}")
    return tensors


def _answered(
    status: int, body: bytes, headers: httpx.Headers, layout: Layout, device: torch.device
) -> PrefillResult:
    """The results a region request's answer points at, copied out of the scratch region (which
    the next request reuses), on the caller's device."""
    if status != 200:
        raise _error(status, body, headers)
    answer = region_request.decode(body, wire.RESPONSE_TENSORS)
    if answer.places.get("out") != layout.places["out"]:
        raise _errors.KernelError("the service answered with another place for out")
    out = layout.out.to(device, copy=True)
    if layout.lse is None:
        return out
    return out, layout.lse.to(device, copy=True)


class _Balancer:
    """Outstanding work per endpoint; `pick` gives the least loaded one not passed over."""

    def __init__(self, n: int) -> None:
        self.outstanding = [0] * n
        self.down_until = [0.0] * n
        self._lock = threading.Lock()
        self._turn = itertools.count()

    def pick(self, tried: set[int]) -> int:
        now = time.monotonic()
        with self._lock:
            n = len(self.outstanding)
            candidates = [i for i in range(n) if i not in tried] or list(range(n))
            up = [i for i in candidates if self.down_until[i] <= now] or candidates
            turn = next(self._turn)
            return min(up, key=lambda i: (self.outstanding[i], (i - turn) % n))

    def begin(self, i: int, work: int) -> None:
        with self._lock:
            self.outstanding[i] += work

    def end(self, i: int, work: int) -> None:
        with self._lock:
            self.outstanding[i] -= work

    def down(self, i: int) -> None:
        with self._lock:
            self.down_until[i] = time.monotonic() + DOWN_FOR


def _urls(url: str | Sequence[str]) -> list[str]:
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise InvalidInputError("url", "one endpoint URL or more", "none")
    return urls


def _next_step(
    exc: Exception, i: int, tried: set[int], n: int, attempt: int, retries: int, bal: _Balancer
) -> float:
    """After a failed attempt on endpoint i: seconds to wait before the next one, or raise.

    The one place transport errors become zen_mla exceptions."""
    tried.add(i)
    if isinstance(exc, httpx.TimeoutException):
        raise DeadlineExceededError(f"no answer in time from endpoint {i}: {exc}") from exc
    if isinstance(exc, httpx.TransportError):
        bal.down(i)
        if attempt >= retries or len(tried) >= n:
            raise ServiceUnavailableError(f"endpoint {i} unreachable: {exc}") from exc
        return 0.0
    assert isinstance(exc, OverloadedError)
    if attempt >= retries:
        raise exc
    if len(tried) < n:
        return 0.0  # another endpoint may have room now
    tried.clear()
    return _retry_wait(exc, attempt)


class PrefillClient:
    """Blocking client; keep-alive connections, reused across calls and threads.

    `url`: the service's base URL, or several (requests go to the least loaded); with `uds=`,
    the host part is only a name. `token`: bearer token when the service has one. `retries`:
    how often 429/503 and unreachable endpoints are retried.
    """

    def __init__(
        self,
        url: str | Sequence[str] = "http://127.0.0.1:8000",
        *,
        token: str | None = None,
        uds: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        retries: int = 3,
        transport: httpx.BaseTransport | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        if transport is None and uds is not None:
            transport = httpx.HTTPTransport(uds=uds)
        urls = _urls(url)
        self._http = [httpx.Client(base_url=u, timeout=timeout, transport=transport) for u in urls]
        self._balancer = _Balancer(len(urls))
        self._token, self._retries = token, retries
        self._shared_memory = shared_memory
        # per endpoint: its regions, None where there are none, missing until first asked
        self._regions: dict[int, RegionSet | None] = {}
        self._regions_lock = threading.Lock()

    def regions(self, i: int = 0) -> RegionSet | None:
        """Endpoint `i`'s same-host regions (asked for once), None where not used."""
        if self._shared_memory is False:
            return None
        with self._regions_lock:
            if i not in self._regions:
                health = self._http[i].get("/health").json()
                self._regions[i] = _regions_of(health, self._token, bool(self._shared_memory))
            return self._regions[i]

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in a region of the first endpoint's service: fill it and pass it to
        `prefill`, which then sends no copy of it (SharedMemoryUnavailableError where the
        service offers no regions reachable from here)."""
        regions = self.regions(0)
        if regions is None:
            raise SharedMemoryUnavailableError("shared memory is off for this client")
        return regions.empty(shape, dtype)

    def prefill(
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
    ) -> PrefillResult:
        """As `zen_mla.ragged_attention`, computed by the service."""
        options = wire.options_metadata(
            causal=causal, return_lse=return_lse, scale=scale, kernel=kernel, request_id=request_id
        )
        tensors = _tensors(q, k, v, q_cu_seq_lens, kv_cu_seq_lens)
        body: tuple[torch.device, list[bytes | memoryview], int] | None = None
        work, tried = _work(q, q_cu_seq_lens, kv_cu_seq_lens, causal), set[int]()
        for attempt in itertools.count():
            i = self._balancer.pick(tried)
            self._balancer.begin(i, work)
            try:
                regions = self.regions(i)
                if regions is not None:
                    return self._post_regions(i, regions, tensors, options, return_lse)
                if body is None:
                    body = _request(tensors, options)
                return self._post(self._http[i], body[1], body[2], body[0], return_lse)
            except (OverloadedError, httpx.TransportError) as exc:
                wait = _next_step(
                    exc, i, tried, len(self._http), attempt, self._retries, self._balancer
                )
            finally:
                self._balancer.end(i, work)
            time.sleep(wait)
        raise AssertionError("unreachable")

    def _post(
        self,
        http: httpx.Client,
        parts: list[bytes | memoryview],
        length: int,
        device: torch.device,
        return_lse: bool,
    ) -> PrefillResult:
        # memoryviews go to the socket as they are (httpx's annotation says bytes)
        content: Any = iter(parts)
        with http.stream(
            "POST", "/prefill", content=content, headers=_headers(self._token, length)
        ) as response:
            if response.status_code != 200:
                raise _error(response.status_code, response.read(), response.headers)
            buf = bytearray(int(response.headers["content-length"]))
            pos = 0
            for chunk in response.iter_raw():
                buf[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
        return _decode(buf, device, return_lse)

    def _post_regions(
        self,
        i: int,
        regions: RegionSet,
        tensors: dict[str, torch.Tensor],
        options: dict[str, str],
        return_lse: bool,
    ) -> PrefillResult:
        with regions.request(tensors, return_lse) as layout:
            body = region_request.encode(layout.places, options)
            r = self._http[i].post("/prefill", content=body, headers=_region_headers(self._token))
            return _answered(r.status_code, r.content, r.headers, layout, tensors["q"].device)

    def health(self) -> dict[str, Any]:
        """The first endpoint's /health JSON (also when it answers 503)."""
        result: dict[str, Any] = self._http[0].get("/health").json()
        return result

    def close(self) -> None:
        for http in self._http:
            http.close()
        for regions in self._regions.values():
            if regions is not None:
                regions.close()

    def __enter__(self) -> PrefillClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncPrefillClient:
    """asyncio client; the same arguments and behaviour as `PrefillClient`."""

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
        if transport is None and uds is not None:
            transport = httpx.AsyncHTTPTransport(uds=uds)
        urls = _urls(url)
        self._http = [
            httpx.AsyncClient(base_url=u, timeout=timeout, transport=transport) for u in urls
        ]
        self._balancer = _Balancer(len(urls))
        self._token, self._retries = token, retries
        self._shared_memory = shared_memory
        self._regions: dict[int, RegionSet | None] = {}  # as PrefillClient's
        self._regions_lock = asyncio.Lock()

    async def regions(self, i: int = 0) -> RegionSet | None:
        """Endpoint `i`'s same-host regions (asked for once), None where not used."""
        if self._shared_memory is False:
            return None
        async with self._regions_lock:
            if i not in self._regions:
                health = (await self._http[i].get("/health")).json()
                self._regions[i] = await asyncio.to_thread(
                    _regions_of, health, self._token, bool(self._shared_memory)
                )
            return self._regions[i]

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
    ) -> PrefillResult:
        options = wire.options_metadata(
            causal=causal, return_lse=return_lse, scale=scale, kernel=kernel, request_id=request_id
        )
        tensors = _tensors(q, k, v, q_cu_seq_lens, kv_cu_seq_lens)
        body: tuple[torch.device, list[bytes | memoryview], int] | None = None
        work, tried = _work(q, q_cu_seq_lens, kv_cu_seq_lens, causal), set[int]()
        for attempt in itertools.count():
            i = self._balancer.pick(tried)
            self._balancer.begin(i, work)
            try:
                regions = await self.regions(i)
                if regions is not None:
                    return await self._post_regions(i, regions, tensors, options, return_lse)
                if body is None:
                    body = _request(tensors, options)
                return await self._post(self._http[i], body[1], body[2], body[0], return_lse)
            except (OverloadedError, httpx.TransportError) as exc:
                wait = _next_step(
                    exc, i, tried, len(self._http), attempt, self._retries, self._balancer
                )
            finally:
                self._balancer.end(i, work)
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def _post(
        self,
        http: httpx.AsyncClient,
        parts: list[bytes | memoryview],
        length: int,
        device: torch.device,
        return_lse: bool,
    ) -> PrefillResult:
        async def body() -> AsyncIterator[bytes]:
            for part in parts:
                yield part  # type: ignore[misc]  # memoryviews go to the socket as they are

        async with http.stream(
            "POST", "/prefill", content=body(), headers=_headers(self._token, length)
        ) as response:
            if response.status_code != 200:
                raise _error(response.status_code, await response.aread(), response.headers)
            buf = bytearray(int(response.headers["content-length"]))
            pos = 0
            async for chunk in response.aiter_raw():
                buf[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
        return _decode(buf, device, return_lse)

    async def _post_regions(
        self,
        i: int,
        regions: RegionSet,
        tensors: dict[str, torch.Tensor],
        options: dict[str, str],
        return_lse: bool,
    ) -> PrefillResult:
        # the copies into the region and out of it run in a thread: the event loop stays free
        stack = contextlib.ExitStack()
        layout = await asyncio.to_thread(stack.enter_context, regions.request(tensors, return_lse))
        with stack:
            body = region_request.encode(layout.places, options)
            r = await self._http[i].post(
                "/prefill", content=body, headers=_region_headers(self._token)
            )
            device = tensors["q"].device
            return await asyncio.to_thread(
                _answered, r.status_code, r.content, r.headers, layout, device
            )

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = (await self._http[0].get("/health")).json()
        return result

    async def aclose(self) -> None:
        for http in self._http:
            await http.aclose()
        for regions in self._regions.values():
            if regions is not None:
                regions.close()

    async def __aenter__(self) -> AsyncPrefillClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
