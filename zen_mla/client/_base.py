"""What `PrefillClient` and `AsyncPrefillClient` share, all but I/O: the client's state
(`BaseClient`) and one prefill request across its attempts (`ClientRequest`): the exchanges it
sends, its regions and its call on the region socket, its answers decoded. Its tensors are
checked by `_inputs`, its endpoint chosen by `_endpoints`, a failed attempt's next step is
`_retry`'s, its deadline `_deadline`'s, and when an exchange is sent again `_resend`'s."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
import torch

from .. import wire
from ..deadline import HEADER, seconds_text
from ..errors import (
    InvalidInputError,
    NotFoundError,
    OverloadedError,
    ServiceUnavailableError,
    SharedMemoryUnavailableError,
    ZenMLAError,
)
from ..regions.connection import Layout, RegionSet, prefill_fields
from ..wire import regions_json
from ..wire.dtypes import BY_SAFETENSORS
from ._answers import AnswerSpec, Bytes, PrefillOutput, answered, called, decoded
from ._deadline import CONNECT_SHARE, Deadline, call_budget
from ._endpoints import Balancer, Endpoint, weigh, where
from ._inputs import checked_tensors
from ._latent import HTTP, MAX_REGISTER_ANSWER, SOCKET, Way, Weights, check_latent
from ._memory import AnswerMemory
from ._names import Lookups
from ._offers import Offer, offered
from ._retry import failover, next_step

__all__ = [
    "DEFAULT_TIMEOUT",
    "HEALTH",
    "PROBE_TIMEOUT",
    "READY",
    "BaseClient",
    "ClientRequest",
    "Exchange",
    "NoRegionError",
]

DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=600.0, pool=600.0)
# httpcore sends a body part with `while buf: n = sock.send(buf); buf = buf[n:]` after h11 joins
# it into bytes: one huge part costs quadratic copying (measured: 0.1 GB/s at 256 MiB). Parts of
# this size keep it to about one copy.
SEND_PART = 256 << 10
MAX_HEALTH_BYTES = 1 << 20  # of /health's JSON
REGION_TIMEOUT = 10.0  # seconds, at most, for one exchange on the region socket
KEEP_ANSWER_BYTES = 256 << 20  # of answer memory kept idle for the next calls (AnswerMemory)


@dataclass(frozen=True, slots=True)
class Exchange:
    """One HTTP exchange to send: `content` as bytes or in parts, a 200's body read up to
    `limit` bytes (`Body`); `tensors`: the answer's tensor bytes, where it holds tensors (a
    large answer goes into the client's `AnswerMemory`)."""

    method: str
    path: str
    limit: int
    content: bytes | list[bytes | memoryview] | None = None
    headers: dict[str, str] | None = None
    tensors: int = 0

    def headers_within(self, deadline: Deadline) -> dict[str, str] | None:
        """The headers an attempt sends: a POST's with what is left of the call's deadline
        (`Zen-MLA-Timeout`), so that the service drops the work still queued when it passes."""
        left = deadline.remaining()
        if self.method != "POST" or left is None:
            return self.headers
        return (self.headers or {}) | {HEADER: seconds_text(left)}


HEALTH = Exchange("GET", "/health", MAX_HEALTH_BYTES)
READY = Exchange("GET", "/health/ready", MAX_HEALTH_BYTES)  # 200 when it takes work
PROBE_TIMEOUT = 2.0  # seconds, at most, for one readiness probe
H = TypeVar("H")  # the twin's HTTP client: httpx.Client or httpx.AsyncClient


# -- one prefill request ---------------------------------------------------------------------------


class NoRegionError(Exception):
    """No region could be had for a request now, and the request may go without one (`shared_memory`
    None): it goes over TCP. Never leaves the client."""


class ClientRequest:
    """One prefill request across its attempts, as the client holds it: the checked tensors, its
    deadline, the endpoints tried. The twins run `attempt()` blocks until one returns, waiting
    `wait` between them."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        options: dict[str, str],
        outputs: AnswerSpec,
        work: int,
        client: BaseClient[Any],
        weight: str | None = None,
    ) -> None:
        self.tensors, self.options, self.outputs = tensors, options, outputs
        self.weight = weight  # a call over the latent cache: the registered weight it names
        self.device = tensors["q"].device
        self.deadline = Deadline(client._budget)
        self.wait = 0.0  # seconds before the next attempt, once one failed
        self._work, self._client = work, client
        self._tried: set[Endpoint[Any]] = set()
        self._attempts = 0
        self._post: Exchange | None = None

    @contextlib.contextmanager
    def attempt(self) -> Iterator[Endpoint[Any]]:
        """The endpoint for the next attempt, its work counted there until the block ends. A
        failure that earns another attempt ends the block (`wait` says when); others are raised.
        An attempt that failed over to another address of the same name (`failover`) counts
        for no retry. While the client has another endpoint, a connect takes at most
        `CONNECT_SHARE` of what the call has left; an attempt the call's deadline ends (a
        timeout, or the asyncio client's call cancelled at it) leaves its endpoint out until
        its readiness probe says 200 (`Balancer.down`), as a refused one."""
        self.deadline.check()
        client = self._client
        bal = client._balancer
        ep = bal.pick(self._tried)
        for due in bal.due():
            client._launch_probe(due)
        self.deadline.connect_share = CONNECT_SHARE if len(bal) > 1 else 1.0
        bal.begin(ep, self._work)
        free = False
        try:
            yield ep
        except (OverloadedError, httpx.TransportError) as exc:
            free = failover(exc, ep, self._tried, bal, self.deadline)
            self.wait = 0.0 if free else next_step(
                exc, ep, self._tried, self._attempts, client._retries, bal, self.deadline,
            )  # fmt: skip
        except BaseException:
            left = self.deadline.remaining()
            if left is not None and left <= 0:
                bal.down(ep)
            raise
        finally:
            bal.end(ep, self._work)
            self._attempts += not free

    def post(self) -> Exchange:
        """The request as a safetensors body, in parts of at most `SEND_PART` bytes, or whole
        where it is no larger (encoded once, whichever attempt sends it); the tensors go over as
        CPU tensors."""
        if self._post is None:
            header, chunks = wire.encode(
                {n: t.detach().cpu() for n, t in self.tensors.items()}, self.options
            )
            parts: list[bytes | memoryview] = [header]
            for chunk in chunks:
                parts.extend(chunk[i : i + SEND_PART] for i in range(0, chunk.nbytes, SEND_PART))
            length = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(length)}
            limit = self.outputs.max_answer
            headers = self._client._auth(headers)
            # a small body goes in one write: a write per tensor is a wake-up of the service
            # per tensor (1 token: 6 writes, 0.4 ms more a call than one, measured on Zen 5)
            content = b"".join(parts) if length <= SEND_PART else parts
            tensors = self.outputs.tensor_bytes
            self._post = Exchange("POST", "/prefill", limit, content, headers, tensors=tensors)
        return self._post

    @contextlib.contextmanager
    def laid_out(self, regions: RegionSet) -> Iterator[Layout]:
        """The request laid out in `regions`, theirs until the block ends (`RegionSet.request`).
        Where no region can be had for it now (the service refused to register one: the user's
        byte budget spent, its regions per connection or of all its clients, no descriptor to
        spare; one could not be made here: memory, descriptors; the region socket failed), the
        error itself with `shared_memory=True`, else NoRegionError: the request goes over TCP, with
        the same answer. Blocking: it copies the tensors in."""
        with contextlib.ExitStack() as stack:
            outputs = self.outputs
            shape, dtype = outputs.want["out"]
            # over the latent cache there is no v to take out's shape from
            out_like = None if "v" in self.tensors else (shape, BY_SAFETENSORS[dtype].torch)
            request = regions.request(
                self.tensors, outputs.return_lse, outputs.into, out_like=out_like
            )
            try:
                layout = stack.enter_context(request)
            except (ZenMLAError, OSError) as exc:
                if self._client._shared_memory:
                    raise
                raise NoRegionError(str(exc)) from exc
            yield layout

    def region_post(self, layout: Layout) -> Exchange:
        """The request naming where its tensors lie in the client's regions."""
        headers = self._client._auth({"Content-Type": regions_json.MEDIA_TYPE})
        content = regions_json.encode(layout.places, self.options)
        return Exchange("POST", "/prefill", wire.MAX_HEADER_BYTES, content, headers)

    def over_socket(self, regions: RegionSet, layout: Layout) -> PrefillOutput | None:
        """The call on the region socket, with no HTTP on its way, where the service takes
        calls there; None where it does not, or while the socket is busy with another call
        (the caller posts `region_post(layout)` instead). Blocking, bounded by the deadline."""
        client = regions.connection
        if not client.calls:
            return None
        try:
            fields = prefill_fields(layout.places, self.options)
            reply = client.try_call(fields, self.deadline.remaining())
        except SharedMemoryUnavailableError as exc:  # the socket broke: the service is gone
            raise ServiceUnavailableError(f"the service's region socket closed: {exc}") from exc
        if reply is None:
            return None
        return called(reply, layout, self.outputs, self.device, self._client._answer_memory)

    def latent_over_socket(self, regions: RegionSet, ep: Endpoint[Any]) -> PrefillOutput | None:
        """A call over the latent cache on the region socket: its weight registered there from a
        region first where it is not yet, and again where the service answers it has none; None
        where the socket is busy with another call (the caller goes over HTTP), NoRegionError
        where no region can be had now (`laid_out`). Blocking, bounded by the deadline."""
        assert self.weight is not None
        try:
            return self._latent_once(regions, ep, self.weight)
        except NotFoundError:  # the weight is gone there (forgotten behind the client's back)
            self._client._weights.mark(ep, self.weight, False, SOCKET)
            return self._latent_once(regions, ep, self.weight)

    def _latent_once(
        self, regions: RegionSet, ep: Endpoint[Any], name: str
    ) -> PrefillOutput | None:
        weights = self._client._weights
        if not weights.held(ep, name, SOCKET):
            try:
                regions.weight(name, weights.tensor(name))
            except SharedMemoryUnavailableError as exc:
                raise ServiceUnavailableError(f"the service's region socket: {exc}") from exc
            weights.mark(ep, name, True, SOCKET)
        with self.laid_out(regions) as layout:
            return self.over_socket(regions, layout)

    def decoded(self, status: int, body: Bytes, headers: httpx.Headers) -> PrefillOutput:
        """The results in the answer to `post()`."""
        return decoded(status, body, headers, self.outputs, self.device)

    def answered(
        self, status: int, body: Bytes, headers: httpx.Headers, layout: Layout
    ) -> PrefillOutput:
        """The results in the answer to `region_post(layout)`, copied out of the region."""
        memory = self._client._answer_memory
        return answered(status, body, headers, layout, self.outputs, self.device, memory)


class BaseClient(Generic[H]):
    """The state the twins share: endpoints, their balance, the regions asked for per endpoint,
    the names looked up again (`_names`). A twin makes each endpoint's HTTP client (`_connect`),
    probes an endpoint that failed (`_launch_probe`), and takes up lookups and closes the
    endpoints gone on each call (its `_refresh`)."""

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        token: str | None,
        timeout: httpx.Timeout | float,
        retries: int,
        shared_memory: bool | None,
        uds: str | None = None,
        resolve_every: float = 5.0,
    ) -> None:
        self._urls = [url] if isinstance(url, str) else list(url)
        if not self._urls:
            raise InvalidInputError("url", "one endpoint URL or more", "none")
        if not resolve_every > 0:
            raise InvalidInputError("resolve_every", "seconds > 0", str(resolve_every))
        self._token, self._retries = token, retries
        self._budget = call_budget(timeout)
        self._shared_memory = shared_memory
        # over a Unix socket the host is only a name: nothing to look up
        self._lookups = Lookups([] if uds else self._urls, resolve_every)
        self._taking = threading.Lock()  # one call at a time applies a lookup
        self._balancer: Balancer[H] = Balancer([self._endpoint(u, None) for u in self._urls])
        self._answer_memory = AnswerMemory(KEEP_ANSWER_BYTES)
        self._weights = Weights()

    def _connect(self, url: httpx.URL, headers: dict[str, str]) -> H:
        """The twin's HTTP client for an endpoint at `url`, sending `headers` with each request."""
        raise NotImplementedError

    def _launch_probe(self, ep: Endpoint[H]) -> None:
        """Probe `ep`'s readiness in the background (`READY`), reporting to `Balancer.probed`."""
        raise NotImplementedError

    def _asking(self) -> Any:
        """The twin's lock an endpoint's regions are asked for under (`Endpoint.asking`)."""
        raise NotImplementedError

    def _endpoint(self, source: str, address: str | None) -> Endpoint[H]:
        http = self._connect(*where(source, address))
        return Endpoint(source, address, http, self._asking())

    @property
    def endpoints(self) -> list[str]:
        """The URLs calls go to now, in order (`health(i)` and `regions(i)` take the index):
        each as given, or for a name one per address it resolved to, the address in place of
        the name. The names' addresses are taken up on calls: before the first, the names."""
        return [str(where(ep.source, ep.address)[0]) for ep in self._balancer.endpoints]

    @property
    def _http(self) -> list[H]:
        """The endpoints' HTTP clients, in order."""
        return [ep.http for ep in self._balancer.endpoints]

    def _take_lookup(self) -> None:
        """A finished lookup of the names applied: each name's new addresses become endpoints
        (taken for ready on the first lookup; probed first on later ones: `Balancer.down`),
        the vanished ones retired, closed once no call is on them (`Balancer.idle`)."""
        if not self._lookups.urls:
            return
        with self._taking:
            taken = self._lookups.take()
            if taken is None:
                return
            found, first = taken
            for source, addresses in found.items():
                if addresses is None:
                    continue  # the lookup failed: what the name had stands
                have = self._balancer.of(source)
                if [e.address for e in have] == addresses:
                    continue
                kept = [e for e in have if e.address in addresses]
                known = {e.address for e in kept}
                new = [self._endpoint(source, a) for a in addresses if a not in known]
                for ep in new if not first else []:
                    self._balancer.down(ep, probe_in=0.0)  # probed on the next call
                self._balancer.place(source, kept + new)

    def _retire(self, ep: Endpoint[H]) -> None:
        """A gone endpoint's regions closed (its HTTP client is the twin's to close)."""
        if ep.offer is not None and ep.offer.regions is not None:
            ep.offer.regions.close()

    def _auth(self, headers: dict[str, str]) -> dict[str, str]:
        """`headers`, with the bearer token where the client has one."""
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _deadline(self) -> Deadline:
        return Deadline(self._budget)

    def _request(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_cu_seq_lens: torch.Tensor,
        kv_cu_seq_lens: torch.Tensor | None,
        *,
        causal: bool,
        return_lse: bool,
        scale: float | None,
        kernel: str,
        request_id: str | None,
        out: torch.Tensor | None = None,
    ) -> ClientRequest:
        """A prefill request of checked options and tensors, as `prefill` takes them."""
        options = wire.options_metadata(
            causal=causal, return_lse=return_lse, scale=scale, kernel=kernel, request_id=request_id
        )
        tensors = checked_tensors(q, k, v, q_cu_seq_lens, kv_cu_seq_lens)
        outputs = AnswerSpec.of(tensors, return_lse, out)
        weight = weigh(q, q_cu_seq_lens, kv_cu_seq_lens, causal)
        return ClientRequest(tensors, options, outputs, weight, self)

    def _latent_request(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        weight: str,
        q_cu_seq_lens: torch.Tensor,
        kv_cu_seq_lens: torch.Tensor | None,
        *,
        causal: bool,
        return_lse: bool,
        scale: float | None,
        form: str,
        precision: str,
        request_id: str | None,
    ) -> ClientRequest:
        """A request over the latent cache, as `prefill_latent` takes it."""
        w_kv_b = self._weights.tensor(weight)
        options = wire.options_metadata(
            causal=causal, return_lse=return_lse, scale=scale, request_id=request_id,
            form=form, weight=weight, precision=precision,
        )  # fmt: skip
        tensors, outputs, work = check_latent(
            q, kv_c, k_pe, q_cu_seq_lens, kv_cu_seq_lens, w_kv_b,
            causal=causal, return_lse=return_lse,
        )  # fmt: skip
        return ClientRequest(tensors, options, outputs, work, self, weight)

    def _weight_put(self, name: str) -> Exchange:
        """The registration of the weight `name` with an endpoint."""
        path, parts, headers = self._weights.put(name, self._auth({}))
        return Exchange("PUT", path, MAX_REGISTER_ANSWER, parts, headers)

    def _weight_delete(self, name: str) -> Exchange:
        return Exchange("DELETE", f"/weights/{name}", MAX_REGISTER_ANSWER, None, self._auth({}))

    def _forgotten_by(self, name: str) -> list[Endpoint[H]]:
        """Forget `name` here, and on the region sockets that hold it (blocking; a socket
        closed since took the weight with it); the endpoints to tell over HTTP
        (`_weight_delete`)."""
        over_http = []
        way: Way
        for ep, way in self._weights.drop(name):
            if way == HTTP:
                over_http.append(ep)
                continue
            regions = ep.offer.regions if ep.offer is not None else None
            if regions is not None and not regions.connection.closed:
                with contextlib.suppress(ZenMLAError):
                    regions.connection.forget(name)
        return over_http

    def _offered(self, status: int, body: Bytes) -> Offer:
        """The regions a /health answer offers (`_offers.offered`). Blocking."""
        timeout = min(REGION_TIMEOUT, self._budget or REGION_TIMEOUT)
        return offered(status, body, self._token, timeout, bool(self._shared_memory))

    def _close_all(self) -> list[Endpoint[H]]:
        """The regions closed, and no answer memory kept any more; the endpoints whose HTTP
        clients the twin then closes."""
        self._answer_memory.close()
        endpoints = self._balancer.everything()
        for ep in endpoints:
            self._retire(ep)
        return endpoints
