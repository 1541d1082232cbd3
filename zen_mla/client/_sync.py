"""`PrefillClient`: the blocking client, its I/O only (the rest is `BaseClient`'s)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import torch

from ..envs import DEFAULT_URL
from ..errors import SharedMemoryUnavailableError
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
from ._transport import DIRECT_MIN, DeadlineTransport, call_deadline, read_body

__all__ = ["PrefillClient"]


class PrefillClient(BaseClient[httpx.Client]):
    """Blocking client; keep-alive connections, reused across calls and threads.

    `url`: the service's base URL (default `DEFAULT_URL`, where `zen-mla serve` listens unless
    told otherwise), or several (requests go to the least loaded); with `uds=`,
    the host part is only a name. A URL whose host is a name stands for every address the name
    resolves to (a Kubernetes headless Service: each ready pod), each an endpoint of its own,
    the name staying the Host header and the TLS server name; the names are looked up again
    once `resolve_every` seconds have passed, on a call, in a thread of their own (`_names`).
    An endpoint that failed (unreachable, timed out, a 503) gets no work while another is up,
    until it answers `GET /health/ready` with 200 (probed in the background). `token`: bearer
    token when the service has one. `timeout`: seconds for a whole pending, retries included
    (an httpx.Timeout: each phase's, and its longest for the whole pending); while the client
    has another endpoint, a connect takes at most a quarter of what is left. `retries`: how often
    429/503 and unreachable endpoints are retried (a call that found an address of a name
    unreachable, or answering 503, goes on to another address of it as no retry); apart from
    them, a request the server never read (a kept connection it closed as the request went
    out) is sent once more on another connection (`_resend.Resend`); once any byte of an
    answer came, never, to no endpoint. `shared_memory`: None uses the service's same-host
    regions where it can, and a call for which it refuses a region now goes over TCP; True
    requires them (the refusal is the call's error); False never uses them. With a
    `transport` of your own, its connects and reads wait as long as it lets them; the call's
    deadline is checked between them; and the client cannot see whether bytes of an answer
    came, so a request is sent again only after a 408 or a failed connect.
    """

    def __init__(
        self,
        url: str | Sequence[str] = DEFAULT_URL,
        *,
        token: str | None = None,
        uds: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        retries: int = 3,
        transport: httpx.BaseTransport | None = None,
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

    def _connect(self, url: httpx.URL, headers: dict[str, str]) -> httpx.Client:
        transport = self._transport or DeadlineTransport(self._uds, self._ssl_context)
        return httpx.Client(
            base_url=url, headers=headers, timeout=self._timeout, transport=transport
        )

    def _asking(self) -> threading.Lock:
        return threading.Lock()

    def _launch_probe(self, ep: Endpoint[httpx.Client]) -> None:
        threading.Thread(target=self._probe, args=(ep,), name="zen-mla-probe", daemon=True).start()

    def _probe(self, ep: Endpoint[httpx.Client]) -> None:
        deadline = Deadline(min(PROBE_TIMEOUT, self._budget or PROBE_TIMEOUT))
        ready = False
        self._balancer.begin(ep, 0)
        try:
            with call_deadline(deadline):
                status = self._send(ep, READY, deadline)[0]
                if status == 404:  # a service older than /health/ready
                    status = self._send(ep, HEALTH, deadline)[0]
            ready = status == 200
        except Exception:  # unreachable, closed meanwhile: not ready
            pass
        finally:
            self._balancer.end(ep, 0)
            self._balancer.probed(ep, ready)

    def _refresh(self, deadline: Deadline) -> None:
        """The names' addresses taken up where a lookup finished, one started where due (the
        first call waits for the first a moment: `FIRST_WAIT`); gone endpoints closed."""
        pending = self._lookups.due()
        if pending is not None and self._lookups.first:
            left = deadline.remaining()
            wait = FIRST_WAIT if left is None else max(0.0, min(FIRST_WAIT, left))
            concurrent.futures.wait([pending], timeout=wait)
        self._take_lookup()
        for ep in self._balancer.idle():
            self._retire(ep)
            if self._transport is None:  # a transport of the caller's serves every endpoint
                ep.http.close()

    @contextlib.contextmanager
    def _on(self, i: int, deadline: Deadline) -> Iterator[Endpoint[httpx.Client]]:
        """Endpoint i for an exchange outside a pending's attempts, its transport errors raised
        as zen_mla's (`Translated`)."""
        self._refresh(deadline)
        ep = self._balancer.at(i)
        self._balancer.begin(ep, 0)
        try:
            with Translated(deadline, ep):
                yield ep
        finally:
            self._balancer.end(ep, 0)

    def regions(self, i: int = 0) -> RegionSet | None:
        """Endpoint `i`'s same-host regions, None where not used (asked for again while the
        service starts, and after it restarted: `_offers`)."""
        deadline = self._deadline()
        with call_deadline(deadline), self._on(i, deadline) as ep:
            return self._regions_for(ep, deadline)

    def _regions_for(
        self, ep: Endpoint[httpx.Client], deadline: Deadline, for_call: bool = False
    ) -> RegionSet | None:
        """The endpoint's regions, asked for where they are not known (`Offer.current`); for a
        pending, None while a region refused for one stands (`Offer.for_calls`)."""
        if self._shared_memory is False:
            return None
        with ep.asking:
            offer = ep.offer
            if offer is None or not offer.current():
                status, _, body = self._send(ep, HEALTH, deadline)
                offer = ep.offer = self._offered(status, body)
            return offer.for_calls() if for_call else offer.regions

    def _refused(self, ep: Endpoint[httpx.Client]) -> None:
        """A region for a call was not to be had at the endpoint (`NoRegionError`)."""
        with ep.asking:
            if ep.offer is not None:
                ep.offer.refused()

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
        return self._call(pending)

    def register_weight(self, name: str, w_kv_b: torch.Tensor) -> None:
        """Keep `w_kv_b` (a layer's `kv_b_proj` weight, `[H * (Dn + Dv), R]`) as the weight
        `name` for `prefill_latent`: registered with each endpoint the first time a call takes
        one there (`PUT /weights/{name}`), never sent with a call. Registering a name again
        replaces its weight."""
        self._weights.add(name, w_kv_b)

    def forget_weight(self, name: str) -> None:
        """Forget the weight `name` here and at every endpoint that holds it."""
        deadline = self._deadline()
        with call_deadline(deadline):
            for ep in self._forgotten_by(name):
                self._send(ep, self._weight_delete(name), deadline)

    def prefill_latent(
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
        """As `zen_mla.latent_attention` with the registered weight `weight` as `w_kv_b`,
        computed by the service: the call carries the latent (`kv_c`, `k_pe`), never the
        context's keys and values, nor the weight."""
        pending = self._latent_request(
            q, kv_c, k_pe, weight, q_cu_seq_lens, kv_cu_seq_lens,
            causal=causal, return_lse=return_lse, scale=scale, form=form, precision=precision,
            request_id=request_id,
        )  # fmt: skip
        return self._call(pending)

    def _call(self, pending: ClientRequest) -> PrefillOutput:
        """`pending` to its answer: attempts on the endpoints, within its deadline."""
        with call_deadline(pending.deadline):
            self._refresh(pending.deadline)
            while True:
                with pending.attempt() as ep:
                    return self._attempt(ep, pending)
                time.sleep(pending.wait)

    def _latent_attempt(self, ep: Endpoint[httpx.Client], pending: ClientRequest) -> PrefillOutput:
        """A call over the latent cache: on the region socket where the endpoint offers one
        (`ClientRequest.latent_over_socket`), else over HTTP, its weight registered there first
        where it is not yet, and again where the endpoint answers it has none (a restarted
        service)."""
        regions = self._regions_for(ep, pending.deadline, for_call=True)
        if regions is not None and regions.connection.calls:
            try:
                result = pending.latent_over_socket(regions, ep)
                if result is not None:
                    return result
            except NoRegionError:
                self._refused(ep)
        name, weights = pending.weight, self._weights
        assert name is not None
        for again in (False, True):
            if not weights.held(ep, name):
                status, headers, body = self._send(ep, self._weight_put(name), pending.deadline)
                registered(status, body, headers)
                weights.mark(ep, name, True)
            status, headers, body = self._send(ep, pending.post(), pending.deadline)
            if status != 404 or again:
                break
            weights.mark(ep, name, False)
        return pending.decoded(status, body, headers)

    def _attempt(self, ep: Endpoint[httpx.Client], pending: ClientRequest) -> PrefillOutput:
        if pending.weight is not None:
            return self._latent_attempt(ep, pending)
        regions = self._regions_for(ep, pending.deadline, for_call=True)
        if regions is not None:
            try:
                return self._over_regions(ep, pending, regions)
            except NoRegionError:
                self._refused(ep)
        status, headers, body = self._send(ep, pending.post(), pending.deadline)
        return pending.decoded(status, body, headers)

    def _over_regions(
        self, ep: Endpoint[httpx.Client], pending: ClientRequest, regions: RegionSet
    ) -> PrefillOutput:
        with pending.laid_out(regions) as layout:
            result = pending.over_socket(regions, layout)
            if result is not None:
                return result
            status, headers, body = self._send(ep, pending.region_post(layout), pending.deadline)
            return pending.answered(status, body, headers, layout)

    def _send(
        self, ep: Endpoint[httpx.Client], x: Exchange, deadline: Deadline
    ) -> tuple[int, httpx.Headers, Bytes]:
        """Status, headers and body of one exchange with the endpoint, sent again where the
        server never read it (`Resend`)."""
        resend = Resend(deadline, idempotent=x.method == "GET")
        while True:
            with resend.send():
                status, headers, body = self._send_once(ep, x, deadline, resend)
                if not resend.again(status):
                    return status, headers, body

    def _send_once(
        self, ep: Endpoint[httpx.Client], x: Exchange, deadline: Deadline, resend: Resend
    ) -> tuple[int, httpx.Headers, Bytes]:
        # parts (memoryviews too) go to the socket as they are (httpx's annotation says bytes)
        content: Any = iter(x.content) if isinstance(x.content, list) else x.content
        http = ep.http
        memory = self._answer_memory if x.tensors else None
        headers = x.headers_within(deadline)
        # whether a large answer is read straight from the socket (`read_body`)
        direct = self._transport is None and http.base_url.scheme == "http"
        if direct and x.tensors >= DIRECT_MIN:
            # read past httpx, the connection cannot serve another request: the service closes
            # it, so that its TIME_WAIT is the service's and not one of this host's ports each
            headers = (headers or {}) | {"Connection": "close"}
        with http.stream(
            x.method, x.path, content=content, headers=headers, extensions=ep.extensions
        ) as answer:
            resend.answered()
            body = Body.of(answer.status_code, answer.headers, x.limit, deadline.check, memory)
            if body.wanted:
                read_body(answer, body, http.timeout.read)
        return answer.status_code, answer.headers, body.whole()

    def health(self, i: int = 0) -> dict[str, Any]:
        """Endpoint `i`'s /health JSON (also when it answers 503); the first by default."""
        deadline = self._deadline()
        with call_deadline(deadline), self._on(i, deadline) as ep:
            status, _, body = self._send(ep, HEALTH, deadline)
        return health_json(status, body)

    def close(self) -> None:
        for ep in self._close_all():
            ep.http.close()

    def __enter__(self) -> PrefillClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
