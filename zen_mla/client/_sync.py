"""`PrefillClient`: the blocking client, its I/O only (the rest is `BaseClient`'s)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import torch

from ..errors import SharedMemoryUnavailableError
from ..regions.client import RegionSet
from ._answers import Body, Bytes, PrefillOutput, health_json
from ._base import DEFAULT_TIMEOUT, HEALTH, BaseClient, ClientRequest, Exchange, NoRegionError
from ._deadline import Deadline
from ._resend import Resend
from ._retry import Translated
from ._transport import DIRECT_MIN, DeadlineTransport, read_body, sync_call

__all__ = ["PrefillClient"]


class PrefillClient(BaseClient):
    """Blocking client; keep-alive connections, reused across calls and threads.

    `url`: the service's base URL, or several (requests go to the least loaded); with `uds=`,
    the host part is only a name. `token`: bearer token when the service has one. `timeout`:
    seconds for a whole pending, retries included (an httpx.Timeout: each phase's, and its longest
    for the whole pending). `retries`: how often 429/503 and unreachable endpoints are retried;
    apart from them, a request the server never read (a kept connection it closed as the
    request went out) is sent once more on another connection (`_resend.Resend`); once any
    byte of an answer came, never, to no endpoint. `shared_memory`: None uses the service's
    same-host regions where it can, and a call for which it refuses a region now goes over
    TCP; True requires them (the refusal is the call's error); False never uses them.
    With a `transport` of your own, its sockets' reads wait as long as it lets them; the call's
    deadline is checked between them; and the client cannot see whether bytes of an answer
    came, so a request is sent again only after a 408 or a failed connect.
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
        super().__init__(
            url, token=token, timeout=timeout, retries=retries, shared_memory=shared_memory
        )
        self._http = [
            httpx.Client(base_url=u, timeout=timeout, transport=transport or DeadlineTransport(uds))
            for u in self._urls
        ]
        # per endpoint: whether a large answer is read straight from the socket (`read_body`)
        self._direct = [transport is None and http.base_url.scheme == "http" for http in self._http]
        self._regions_lock = threading.Lock()  # guards self._regions

    def regions(self, i: int = 0) -> RegionSet | None:
        """Endpoint `i`'s same-host regions, None where not used (asked for again while the
        service starts, and after it restarted: `_offers`)."""
        deadline = self._deadline()
        with sync_call(deadline), Translated(deadline, i):
            return self._regions_for(i, deadline)

    def _regions_for(self, i: int, deadline: Deadline, for_call: bool = False) -> RegionSet | None:
        """Endpoint i's regions, asked for where they are not known (`Offer.current`); for a
        pending, None while a region refused for one stands (`Offer.for_calls`)."""
        if self._shared_memory is False:
            return None
        with self._regions_lock:
            offer = self._regions.get(i)
            if offer is None or not offer.current():
                status, _, body = self._send(i, HEALTH, deadline)
                offer = self._regions[i] = self._offered(status, body)
            return offer.for_calls() if for_call else offer.regions

    def _refused(self, i: int) -> None:
        """A region for a call was not to be had at endpoint i (`NoRegionError`)."""
        with self._regions_lock:
            offer = self._regions.get(i)
            if offer is not None:
                offer.refused()

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
        out: torch.Tensor | None = None,
    ) -> PrefillOutput:
        """As `zen_mla.ragged_attention`, computed by the service. `out`: a `[Tq, H, Dv]`
        tensor in v's dtype (on any device, any strides) that the result is written to and
        returned as, with no tensor of the client's in between (checked before anything is
        sent: InvalidInputError names it); one made by `empty()` is written where it lies by
        the service (no copy), unless an LSE is asked. After a failed call its contents are
        undefined."""
        pending = self._request(
            q, k, v, q_cu_seq_lens, kv_cu_seq_lens,
            causal=causal, return_lse=return_lse, scale=scale, kernel=kernel,
            request_id=request_id, out=out,
        )  # fmt: skip
        with sync_call(pending.deadline):
            while True:
                with pending.attempt() as i:
                    return self._attempt(i, pending)
                time.sleep(pending.wait)

    def _attempt(self, i: int, pending: ClientRequest) -> PrefillOutput:
        regions = self._regions_for(i, pending.deadline, for_call=True)
        if regions is not None:
            try:
                return self._over_regions(i, pending, regions)
            except NoRegionError:
                self._refused(i)
        status, headers, body = self._send(i, pending.post(), pending.deadline)
        return pending.decoded(status, body, headers)

    def _over_regions(self, i: int, pending: ClientRequest, regions: RegionSet) -> PrefillOutput:
        with pending.laid_out(regions) as layout:
            result = pending.over_socket(regions, layout)
            if result is not None:
                return result
            status, headers, body = self._send(i, pending.region_post(layout), pending.deadline)
            return pending.answered(status, body, headers, layout)

    def _send(self, i: int, x: Exchange, deadline: Deadline) -> tuple[int, httpx.Headers, Bytes]:
        """Status, headers and body of one exchange with endpoint i, sent again where the
        server never read it (`Resend`)."""
        resend = Resend(deadline, idempotent=x.method == "GET")
        while True:
            with resend.send():
                status, headers, body = self._send_once(i, x, deadline, resend)
                if not resend.again(status):
                    return status, headers, body

    def _send_once(
        self, i: int, x: Exchange, deadline: Deadline, resend: Resend
    ) -> tuple[int, httpx.Headers, Bytes]:
        # parts (memoryviews too) go to the socket as they are (httpx's annotation says bytes)
        content: Any = iter(x.content) if isinstance(x.content, list) else x.content
        http = self._http[i]
        memory = self._answer_memory if x.tensors else None
        headers = x.headers
        if self._direct[i] and x.tensors >= DIRECT_MIN:
            # read past httpx, the connection cannot serve another request: the service closes
            # it, so that its TIME_WAIT is the service's and not one of this host's ports each
            headers = (headers or {}) | {"Connection": "close"}
        with http.stream(x.method, x.path, content=content, headers=headers) as answer:
            resend.answered()
            body = Body.of(answer.status_code, answer.headers, x.limit, deadline.check, memory)
            if body.wanted:
                read_body(answer, body, http.timeout.read)
        return answer.status_code, answer.headers, body.whole()

    def health(self) -> dict[str, Any]:
        """The first endpoint's /health JSON (also when it answers 503)."""
        deadline = self._deadline()
        with sync_call(deadline), Translated(deadline, 0):
            status, _, body = self._send(0, HEALTH, deadline)
        return health_json(status, body)

    def close(self) -> None:
        for http in self._http:
            http.close()
        self._close_memory()

    def __enter__(self) -> PrefillClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
