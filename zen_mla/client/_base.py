"""What `PrefillClient` and `AsyncPrefillClient` share, all but I/O: the client's state
(`BaseClient`) and one prefill request across its attempts (`ClientRequest`): the exchanges it
sends, its regions and its call on the region socket, its answers decoded. Its tensors are
checked by `_inputs`, its endpoint chosen by `_endpoints`, a failed attempt's next step is
`_retry`'s, its deadline `_deadline`'s, and when an exchange is sent again `_resend`'s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx
import torch

from .. import wire
from ..errors import (
    InvalidInputError,
    OverloadedError,
    ServiceUnavailableError,
    SharedMemoryUnavailableError,
    ZenMLAError,
)
from ..regions.client import Layout, RegionSet, prefill_fields
from ..wire import regions_json
from ._answers import AnswerSpec, Bytes, PrefillOutput, answered, called, decoded
from ._deadline import Deadline, call_budget
from ._endpoints import Balancer, weigh
from ._inputs import checked_tensors
from ._memory import AnswerMemory
from ._offers import Offer, offered
from ._retry import next_step

__all__ = [
    "DEFAULT_TIMEOUT",
    "HEALTH",
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


HEALTH = Exchange("GET", "/health", MAX_HEALTH_BYTES)


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
        client: BaseClient,
    ) -> None:
        self.tensors, self.options, self.outputs = tensors, options, outputs
        self.device = tensors["q"].device
        self.deadline = Deadline(client._budget)
        self.wait = 0.0  # seconds before the next attempt, once one failed
        self._work, self._client = work, client
        self._tried: set[int] = set()
        self._attempts = 0
        self._post: Exchange | None = None

    @contextlib.contextmanager
    def attempt(self) -> Iterator[int]:
        """The endpoint for the next attempt, its work counted there until the block ends. A
        failure that earns another attempt ends the block (`wait` says when); others are raised."""
        self.deadline.check()
        client = self._client
        i = client._balancer.pick(self._tried)
        client._balancer.begin(i, self._work)
        try:
            yield i
        except (OverloadedError, httpx.TransportError) as exc:
            self.wait = next_step(
                exc, i, self._tried, self._attempts, client._retries, client._balancer,
                self.deadline,
            )  # fmt: skip
        finally:
            client._balancer.end(i, self._work)
            self._attempts += 1

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
            request = regions.request(self.tensors, self.outputs.return_lse, self.outputs.into)
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
        client = regions.client
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

    def decoded(self, status: int, body: Bytes, headers: httpx.Headers) -> PrefillOutput:
        """The results in the answer to `post()`."""
        return decoded(status, body, headers, self.outputs, self.device)

    def answered(
        self, status: int, body: Bytes, headers: httpx.Headers, layout: Layout
    ) -> PrefillOutput:
        """The results in the answer to `region_post(layout)`, copied out of the region."""
        memory = self._client._answer_memory
        return answered(status, body, headers, layout, self.outputs, self.device, memory)


class BaseClient:
    """The state the twins share: endpoints, their balance, the regions asked for per endpoint."""

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        token: str | None,
        timeout: httpx.Timeout | float,
        retries: int,
        shared_memory: bool | None,
    ) -> None:
        self._urls = [url] if isinstance(url, str) else list(url)
        if not self._urls:
            raise InvalidInputError("url", "one endpoint URL or more", "none")
        self._balancer = Balancer(len(self._urls))
        self._token, self._retries = token, retries
        self._budget = call_budget(timeout)
        self._shared_memory = shared_memory
        # per endpoint: its Offer (`regions` None where none are used), missing until first
        # asked, asked again once not `current()`
        self._regions: dict[int, Offer] = {}
        self._answer_memory = AnswerMemory(KEEP_ANSWER_BYTES)

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

    def _offered(self, status: int, body: Bytes) -> Offer:
        """The regions a /health answer offers (`_offers.offered`). Blocking."""
        timeout = min(REGION_TIMEOUT, self._budget or REGION_TIMEOUT)
        return offered(status, body, self._token, timeout, bool(self._shared_memory))

    def _close_memory(self) -> None:
        """The regions closed, and no answer memory kept any more."""
        self._answer_memory.close()
        for offer in self._regions.values():
            if offer.regions is not None:
                offer.regions.close()
