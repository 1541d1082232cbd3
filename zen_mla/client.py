"""Clients of the zen-mla service, on httpx: `PrefillClient` and `AsyncPrefillClient`.

    with PrefillClient("http://127.0.0.1:8000") as client:
        out, lse = client.prefill(q, k, v, q_cu_seq_lens, return_lse=True)

`prefill` takes and returns what `zen_mla.ragged_attention` does; tensors on another device
(CUDA) go over as CPU tensors and come back on the caller's device. Errors arrive as the same
zen_mla exceptions the service raised; 429 and 503 are retried after `Retry-After`, a few times.

`timeout` bounds a whole call (connect, send, wait, read, and the retries with their waits), not
each read: past it, DeadlineExceededError. Every answer is checked against its request (`out`
[Tq, H, Dv] in v's dtype, `lse` [H, Tq] float32 only when asked, no other names) and read only
up to the bytes the request can need; an answer that breaks the protocol is a ProtocolError.
Every failure is a ZenMLAError.

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
import contextvars
import itertools
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx
import torch

from . import errors, wire
from .attention.batch import visible_pairs
from .errors import (
    BY_STATUS,
    DeadlineExceededError,
    InvalidInputError,
    OverloadedError,
    ProtocolError,
    ServiceUnavailableError,
    SharedMemoryUnavailableError,
    ZenMLAError,
)
from .regions.client import Layout, RegionClient, RegionSet
from .wire import regions_json
from .wire.dtypes import BY_SAFETENSORS, BY_TORCH

__all__ = ["AsyncPrefillClient", "PrefillClient"]

DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=600.0, pool=600.0)
# httpcore sends a body part with `while buf: n = sock.send(buf); buf = buf[n:]` after h11 joins
# it into bytes: one huge part costs quadratic copying (measured: 0.1 GB/s at 256 MiB). Parts of
# this size keep it to about one copy.
SEND_PART = 256 << 10
MAX_RETRY_WAIT = 30.0
DOWN_FOR = 5.0  # seconds an unreachable endpoint is passed over
MAX_PROBLEM_BYTES = 64 << 10  # of an error's body; the rest is not read
MAX_HEALTH_BYTES = 1 << 20  # of /health's JSON
REGION_TIMEOUT = 10.0  # seconds, at most, for one exchange on the region socket

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


# -- one call, one deadline ----------------------------------------------------------------------


def _budget(timeout: httpx.Timeout | float) -> float | None:
    """A whole call's seconds: a number as it is; an httpx.Timeout's longest phase (None, no
    bound, when a phase has none)."""
    if isinstance(timeout, httpx.Timeout):
        phases = (timeout.connect, timeout.read, timeout.write, timeout.pool)
        return None if any(p is None for p in phases) else max(p for p in phases if p is not None)
    return float(timeout)


class _Deadline:
    """When one call (connect, send, wait, read, and the retries with their waits) must end."""

    def __init__(self, budget: float | None) -> None:
        self.budget = budget
        self._at = None if budget is None else time.monotonic() + budget

    def remaining(self) -> float | None:
        """Seconds left, <= 0 once past; None without a bound."""
        return None if self._at is None else self._at - time.monotonic()

    def check(self) -> None:
        left = self.remaining()
        if left is not None and left <= 0:
            raise self.exceeded()

    def exceeded(self) -> DeadlineExceededError:
        return DeadlineExceededError(f"no answer within the call's timeout of {self.budget:g} s")


# The calling thread's call (PrefillClient sets it for the call's length): its sockets' reads
# and writes wait at most what the call has left.
_CALL_DEADLINE: contextvars.ContextVar[_Deadline | None] = contextvars.ContextVar(
    "zen_mla_call_deadline", default=None
)


@contextlib.contextmanager
def _sync_call(deadline: _Deadline) -> Iterator[None]:
    token = _CALL_DEADLINE.set(deadline)
    try:
        yield
    finally:
        _CALL_DEADLINE.reset(token)


@contextlib.asynccontextmanager
async def _async_call(deadline: _Deadline) -> AsyncIterator[None]:
    """The call's task is cancelled at the deadline, whatever it awaits."""
    try:
        async with asyncio.timeout(deadline.remaining()) as scope:
            yield
    except TimeoutError as exc:
        if scope.expired() and not isinstance(exc, ZenMLAError):
            raise deadline.exceeded() from exc
        raise


def _op_timeout(timeout: float | None, late: type[Exception]) -> float | None:
    """A socket operation's timeout, cut to what the calling thread's call has left."""
    deadline = _CALL_DEADLINE.get()
    left = None if deadline is None else deadline.remaining()
    if left is None:
        return timeout
    if left <= 0:
        raise late("the call's timeout has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _op_timeout(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _op_timeout(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        timeout = _op_timeout(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        timeout = _op_timeout(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(
            self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        timeout = _op_timeout(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._backend.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _Transport(httpx.HTTPTransport):
    """httpx's transport whose sockets wait at most what the calling thread's call has left.

    httpx bounds each read, and an answer trickled a byte at a time (headers too, which httpcore
    reads in its own loop) never trips that; the asyncio client cancels its call instead."""

    def __init__(self, uds: str | None) -> None:
        ssl_context = httpx.create_ssl_context()
        super().__init__(verify=ssl_context, uds=uds)
        # httpx takes no network backend: its pool is made again, as httpx makes it, with one
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            uds=uds,
            network_backend=_DeadlineBackend(),
        )


# -- reading an answer ---------------------------------------------------------------------------


def _content_length(headers: httpx.Headers) -> int | None:
    values = set(headers.get_list("content-length"))
    if not values:
        return None
    text = values.pop()
    if values or not (text.isascii() and text.isdigit() and len(text) <= 20):
        raise ProtocolError(f"Content-Length: expected a number of bytes, got {text!r:.40}")
    return int(text)


class _Body:
    """An answer's bytes as they come, never more than `limit`: an answer announced or running
    past it is a ProtocolError before the rest is read; with `cut`, the rest is left unread."""

    def __init__(self, headers: httpx.Headers, limit: int, deadline: _Deadline, cut: bool) -> None:
        self.length = _content_length(headers)
        self._limit, self._deadline, self._cut, self._pos = limit, deadline, cut, 0
        # False: nothing is to be read (a problem announced past its cap is not waited for)
        self.wanted = self.length is None or self.length <= limit
        if not self.wanted and not cut:
            raise ProtocolError(
                f"the service announced a {self.length}-byte answer; "
                f"this request's is at most {limit} bytes"
            )
        # where the length is known, the answer lands in one buffer of that size (the decoded
        # tensors are views of it)
        self.buf = bytearray(self.length if self.length is not None and not cut else 0)

    @classmethod
    def of(cls, status: int, headers: httpx.Headers, limit: int, deadline: _Deadline) -> _Body:
        """200: the answer, `limit` bytes at most; another status: its problem, cut short."""
        if status == 200:
            return cls(headers, limit, deadline, cut=False)
        return cls(headers, MAX_PROBLEM_BYTES, deadline, cut=True)

    def take(self, chunk: bytes) -> bool:
        """Keep `chunk`; False once no more is to be read."""
        self._deadline.check()
        end = self._pos + len(chunk)
        if end > self._limit:
            if self._cut:
                self.buf += chunk[: self._limit - self._pos]
                return False
            raise ProtocolError(
                f"the service's answer runs past {self._limit} bytes, the most this request needs"
            )
        if self.length is not None and not self._cut:
            if end > self.length:
                raise ProtocolError(f"the answer runs past its Content-Length of {self.length}")
            self.buf[self._pos : end] = chunk
        else:
            self.buf += chunk
        self._pos = end
        return True

    def whole(self) -> bytearray:
        if self.wanted and self.length is not None and not self._cut and self._pos != self.length:
            raise ProtocolError(f"the answer ended after {self._pos} of its {self.length} bytes")
        return self.buf


def _json_object(body: bytes | bytearray) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _error(status: int, body: bytes | bytearray, headers: httpx.Headers) -> ZenMLAError:
    """The exception the service raised, from its problem+json (one table: `errors`), its fix
    hint included; a body that is not a JSON object still gives the status's class."""
    problem = _json_object(body)
    if problem is None:
        problem = {"detail": bytes(body[:200]).decode("utf-8", "replace") or f"HTTP {status}"}
    name = str(problem.get("type", "")).rpartition(":")[2]
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ZenMLAError)):
        cls = BY_STATUS.get(status, ZenMLAError)
    detail = str(problem.get("detail") or f"HTTP {status}")[:2000]
    if issubclass(cls, InvalidInputError):
        hint = problem.get("hint")
        return cls(
            str(problem.get("tensor") or "body"),
            str(problem.get("expected") or "a valid request"),
            str(problem.get("got") or detail),
            hint if isinstance(hint, str) else "",
        )
    if issubclass(cls, OverloadedError):
        retry = headers.get("retry-after")
        ok = retry is not None and retry.isascii() and retry.isdigit()
        return cls(detail, float(retry) if ok and retry else None)
    return cls(detail)


@dataclass(frozen=True, slots=True)
class _Outputs:
    """What the answer to a request must hold, by name: (shape, dtype as safetensors names it).
    `out` [Tq, H, Dv] in v's dtype; `lse` [H, Tq] float32, only when asked."""

    want: dict[str, tuple[tuple[int, ...], str]]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], return_lse: bool) -> _Outputs:
        q, v = tensors["q"], tensors["v"]
        tq, heads = int(q.shape[0]), int(q.shape[1])
        want: dict[str, tuple[tuple[int, ...], str]] = {
            "out": ((tq, heads, int(v.shape[2])), BY_TORCH[v.dtype].safetensors)
        }
        if return_lse:
            want["lse"] = ((heads, tq), "F32")
        return cls(want)

    @property
    def return_lse(self) -> bool:
        return "lse" in self.want

    @property
    def max_answer(self) -> int:
        """The most bytes a safetensors answer can take: the header cap and the tensors."""
        data = sum(math.prod(s) * BY_SAFETENSORS[d].torch.itemsize for s, d in self.want.values())
        return 8 + wire.MAX_HEADER_BYTES + data

    def check(self, got: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
        if set(got) != set(self.want):
            raise ProtocolError(
                f"answer: expected tensors {sorted(self.want)}, got {sorted(got)[:5]}"
            )
        for name, (shape, dtype) in self.want.items():
            if got[name] != (shape, dtype):
                raise ProtocolError(
                    f"{name}: expected {dtype} {list(shape)}, got {got[name][1]} "
                    f"{list(got[name][0])}"
                )


def _decoded(
    status: int,
    body: bytearray,
    headers: httpx.Headers,
    outputs: _Outputs,
    device: torch.device,
) -> PrefillResult:
    """The results in a /prefill answer, checked against the request, on the caller's device."""
    if status != 200:
        raise _error(status, body, headers)
    try:
        # ValueError: torch.frombuffer of no bytes, and the decoder's errors (a ValueError each)
        raw = torch.frombuffer(body, dtype=torch.uint8)
        tensors, _meta = wire.decode(raw, wire.RESPONSE_TENSORS)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the answer is not a readable safetensors file: {exc}") from exc
    outputs.check({n: (tuple(t.shape), BY_TORCH[t.dtype].safetensors) for n, t in tensors.items()})
    out = tensors["out"].to(device)
    if outputs.return_lse:
        return out, tensors["lse"].to(device)
    return out


def _answered(
    status: int,
    body: bytearray,
    headers: httpx.Headers,
    layout: Layout,
    outputs: _Outputs,
    device: torch.device,
) -> PrefillResult:
    """The results a region request's answer points at, checked against the request and copied
    out of the scratch region (which the next request reuses), on the caller's device."""
    if status != 200:
        raise _error(status, body, headers)
    try:
        answer = regions_json.decode(bytes(body), wire.RESPONSE_TENSORS)
    except ZenMLAError as exc:
        raise ProtocolError(f"the answer is not a readable region answer: {exc}") from exc
    outputs.check({n: (p.shape, p.dtype) for n, p in answer.places.items()})
    for name, place in answer.places.items():
        if place != layout.places[name]:
            raise ProtocolError(f"{name}: expected written at {layout.places[name]}, got {place}")
    out = layout.out.to(device, copy=True)
    if layout.lse is None:
        return out
    return out, layout.lse.to(device, copy=True)


def _health(status: int, body: bytearray) -> dict[str, Any]:
    health = _json_object(body)
    if health is None:
        raise ProtocolError(
            f"/health: expected a JSON object, got HTTP {status} with {bytes(body[:80])!r}"
        )
    return health


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


def _regions_of(
    status: int, body: bytearray, token: str | None, required: bool, timeout: float
) -> RegionSet | None:
    """The same-host regions of the service whose /health answer this is, or None where they
    cannot be had (SharedMemoryUnavailableError instead when `required`). The region socket must
    answer with the instance /health names: a path that exists here may belong to another
    service than the one at this URL."""
    try:
        try:
            offer = _health(status, body).get("shared_memory")
        except ProtocolError as exc:
            raise SharedMemoryUnavailableError(f"no regions offered: {exc}") from exc
        if not isinstance(offer, dict) or not offer.get("socket"):
            raise SharedMemoryUnavailableError("the service offers no shared memory")
        client = RegionClient(str(offer["socket"]), token, timeout)
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
    headers = {"Content-Type": regions_json.MEDIA_TYPE}
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
        if t.dtype not in BY_TORCH:
            raise InvalidInputError(
                name, f"a dtype among {', '.join(BY_SAFETENSORS)}", str(t.dtype)
            )
    return tensors


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


def _transport_error(exc: httpx.TransportError, deadline: _Deadline, i: int) -> ZenMLAError:
    """The one place transport errors become zen_mla exceptions."""
    if isinstance(exc, httpx.TimeoutException):
        left = deadline.remaining()
        if left is not None and left <= 0:
            return deadline.exceeded()
        return DeadlineExceededError(f"no answer in time from endpoint {i}: {exc}")
    return ServiceUnavailableError(f"endpoint {i} unreachable: {exc}")


def _next_step(
    exc: Exception,
    i: int,
    tried: set[int],
    n: int,
    attempt: int,
    retries: int,
    bal: _Balancer,
    deadline: _Deadline,
) -> float:
    """After a failed attempt on endpoint i: seconds to wait before the next one, or raise. A
    wait that would end past the call's deadline is not waited: the error is raised now."""
    tried.add(i)
    if isinstance(exc, httpx.TransportError):
        error = _transport_error(exc, deadline, i)
        if isinstance(error, DeadlineExceededError):
            raise error from exc
        bal.down(i)
        if attempt >= retries or len(tried) >= n:
            raise error from exc
        return 0.0
    if not isinstance(exc, OverloadedError) or attempt >= retries:
        raise exc
    if len(tried) < n:
        return 0.0  # another endpoint may have room now
    tried.clear()
    wait = _retry_wait(exc, attempt)
    left = deadline.remaining()
    if left is not None and wait >= left:
        exc.add_note(f"not retried: the wait of {wait:g} s ends past the call's timeout")
        raise exc
    return wait


class PrefillClient:
    """Blocking client; keep-alive connections, reused across calls and threads.

    `url`: the service's base URL, or several (requests go to the least loaded); with `uds=`,
    the host part is only a name. `token`: bearer token when the service has one. `timeout`:
    seconds for a whole call, retries included (an httpx.Timeout: each phase's, and its longest
    for the whole call). `retries`: how often 429/503 and unreachable endpoints are retried.
    With a `transport` of your own, its sockets' reads wait as long as it lets them; the call's
    deadline is checked between them.
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
        urls = _urls(url)
        self._http = [
            httpx.Client(base_url=u, timeout=timeout, transport=transport or _Transport(uds))
            for u in urls
        ]
        self._balancer = _Balancer(len(urls))
        self._token, self._retries = token, retries
        self._budget = _budget(timeout)
        self._shared_memory = shared_memory
        # per endpoint: its regions, None where there are none, missing until first asked
        self._regions: dict[int, RegionSet | None] = {}
        self._regions_lock = threading.Lock()

    def regions(self, i: int = 0) -> RegionSet | None:
        """Endpoint `i`'s same-host regions (asked for once), None where not used."""
        deadline = _Deadline(self._budget)
        with _sync_call(deadline):
            try:
                return self._regions_for(i, deadline)
            except httpx.TransportError as exc:
                raise _transport_error(exc, deadline, i) from exc

    def _regions_for(self, i: int, deadline: _Deadline) -> RegionSet | None:
        if self._shared_memory is False:
            return None
        with self._regions_lock:
            if i not in self._regions:
                status, _, body = self._send(i, "GET", "/health", MAX_HEALTH_BYTES, deadline)
                timeout = min(REGION_TIMEOUT, self._budget or REGION_TIMEOUT)
                required = bool(self._shared_memory)
                self._regions[i] = _regions_of(status, body, self._token, required, timeout)
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
        outputs = _Outputs.of(tensors, return_lse)
        body: tuple[torch.device, list[bytes | memoryview], int] | None = None
        work, tried = _work(q, q_cu_seq_lens, kv_cu_seq_lens, causal), set[int]()
        deadline = _Deadline(self._budget)
        with _sync_call(deadline):
            for attempt in itertools.count():
                deadline.check()
                i = self._balancer.pick(tried)
                self._balancer.begin(i, work)
                try:
                    regions = self._regions_for(i, deadline)
                    if regions is not None:
                        return self._post_regions(i, regions, tensors, options, outputs, deadline)
                    if body is None:
                        body = _request(tensors, options)
                    return self._post(i, body, outputs, deadline)
                except (OverloadedError, httpx.TransportError) as exc:
                    wait = _next_step(
                        exc, i, tried, len(self._http), attempt, self._retries, self._balancer,
                        deadline,
                    )  # fmt: skip
                finally:
                    self._balancer.end(i, work)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _send(
        self,
        i: int,
        method: str,
        path: str,
        limit: int,
        deadline: _Deadline,
        content: Any = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, httpx.Headers, bytearray]:
        """Status, headers and body of one exchange with endpoint i; a 200's body is read up to
        `limit` bytes (`_Body`)."""
        with self._http[i].stream(method, path, content=content, headers=headers) as response:
            body = _Body.of(response.status_code, response.headers, limit, deadline)
            if body.wanted:
                for chunk in response.iter_raw():
                    if not body.take(chunk):
                        break
        return response.status_code, response.headers, body.whole()

    def _post(
        self,
        i: int,
        request: tuple[torch.device, list[bytes | memoryview], int],
        outputs: _Outputs,
        deadline: _Deadline,
    ) -> PrefillResult:
        device, parts, length = request
        # memoryviews go to the socket as they are (httpx's annotation says bytes)
        status, headers, body = self._send(
            i, "POST", "/prefill", outputs.max_answer, deadline, iter(parts),
            _headers(self._token, length),
        )  # fmt: skip
        return _decoded(status, body, headers, outputs, device)

    def _post_regions(
        self,
        i: int,
        regions: RegionSet,
        tensors: dict[str, torch.Tensor],
        options: dict[str, str],
        outputs: _Outputs,
        deadline: _Deadline,
    ) -> PrefillResult:
        with regions.request(tensors, outputs.return_lse) as layout:
            request = regions_json.encode(layout.places, options)
            status, headers, body = self._send(
                i, "POST", "/prefill", wire.MAX_HEADER_BYTES, deadline, request,
                _region_headers(self._token),
            )  # fmt: skip
            device = tensors["q"].device
            return _answered(status, body, headers, layout, outputs, device)

    def health(self) -> dict[str, Any]:
        """The first endpoint's /health JSON (also when it answers 503)."""
        deadline = _Deadline(self._budget)
        with _sync_call(deadline):
            try:
                status, _, body = self._send(0, "GET", "/health", MAX_HEALTH_BYTES, deadline)
            except httpx.TransportError as exc:
                raise _transport_error(exc, deadline, 0) from exc
        return _health(status, body)

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
        if transport is None and uds is not None:
            transport = httpx.AsyncHTTPTransport(uds=uds)
        urls = _urls(url)
        self._http = [
            httpx.AsyncClient(base_url=u, timeout=timeout, transport=transport) for u in urls
        ]
        self._balancer = _Balancer(len(urls))
        self._token, self._retries = token, retries
        self._budget = _budget(timeout)
        self._shared_memory = shared_memory
        self._regions: dict[int, RegionSet | None] = {}  # as PrefillClient's
        self._regions_lock = asyncio.Lock()

    async def regions(self, i: int = 0) -> RegionSet | None:
        """Endpoint `i`'s same-host regions (asked for once), None where not used."""
        deadline = _Deadline(self._budget)
        async with _async_call(deadline):
            try:
                return await self._regions_for(i, deadline)
            except httpx.TransportError as exc:
                raise _transport_error(exc, deadline, i) from exc

    async def _regions_for(self, i: int, deadline: _Deadline) -> RegionSet | None:
        if self._shared_memory is False:
            return None
        async with self._regions_lock:
            if i not in self._regions:
                status, _, body = await self._send(i, "GET", "/health", MAX_HEALTH_BYTES, deadline)
                timeout = min(REGION_TIMEOUT, self._budget or REGION_TIMEOUT)
                self._regions[i] = await asyncio.to_thread(
                    _regions_of, status, body, self._token, bool(self._shared_memory), timeout
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
        outputs = _Outputs.of(tensors, return_lse)
        body: tuple[torch.device, list[bytes | memoryview], int] | None = None
        work, tried = _work(q, q_cu_seq_lens, kv_cu_seq_lens, causal), set[int]()
        deadline = _Deadline(self._budget)
        async with _async_call(deadline):
            for attempt in itertools.count():
                deadline.check()
                i = self._balancer.pick(tried)
                self._balancer.begin(i, work)
                try:
                    regions = await self._regions_for(i, deadline)
                    if regions is not None:
                        return await self._post_regions(
                            i, regions, tensors, options, outputs, deadline
                        )
                    if body is None:
                        body = _request(tensors, options)
                    return await self._post(i, body, outputs, deadline)
                except (OverloadedError, httpx.TransportError) as exc:
                    wait = _next_step(
                        exc, i, tried, len(self._http), attempt, self._retries, self._balancer,
                        deadline,
                    )  # fmt: skip
                finally:
                    self._balancer.end(i, work)
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def _send(
        self,
        i: int,
        method: str,
        path: str,
        limit: int,
        deadline: _Deadline,
        content: Any = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, httpx.Headers, bytearray]:
        """As `PrefillClient._send`."""
        async with self._http[i].stream(method, path, content=content, headers=headers) as response:
            body = _Body.of(response.status_code, response.headers, limit, deadline)
            if body.wanted:
                async for chunk in response.aiter_raw():
                    if not body.take(chunk):
                        break
        return response.status_code, response.headers, body.whole()

    async def _post(
        self,
        i: int,
        request: tuple[torch.device, list[bytes | memoryview], int],
        outputs: _Outputs,
        deadline: _Deadline,
    ) -> PrefillResult:
        device, parts, length = request

        async def content() -> AsyncIterator[bytes]:
            for part in parts:
                yield part  # type: ignore[misc]  # memoryviews go to the socket as they are

        status, headers, body = await self._send(
            i, "POST", "/prefill", outputs.max_answer, deadline, content(),
            _headers(self._token, length),
        )  # fmt: skip
        return _decoded(status, body, headers, outputs, device)

    async def _post_regions(
        self,
        i: int,
        regions: RegionSet,
        tensors: dict[str, torch.Tensor],
        options: dict[str, str],
        outputs: _Outputs,
        deadline: _Deadline,
    ) -> PrefillResult:
        # the copies into the region and out of it run in a thread: the event loop stays free
        stack = contextlib.ExitStack()
        layout = await asyncio.to_thread(
            stack.enter_context, regions.request(tensors, outputs.return_lse)
        )
        with stack:
            request = regions_json.encode(layout.places, options)
            status, headers, body = await self._send(
                i, "POST", "/prefill", wire.MAX_HEADER_BYTES, deadline, request,
                _region_headers(self._token),
            )  # fmt: skip
            device = tensors["q"].device
            return await asyncio.to_thread(
                _answered, status, body, headers, layout, outputs, device
            )

    async def health(self) -> dict[str, Any]:
        deadline = _Deadline(self._budget)
        async with _async_call(deadline):
            try:
                status, _, body = await self._send(0, "GET", "/health", MAX_HEALTH_BYTES, deadline)
            except httpx.TransportError as exc:
                raise _transport_error(exc, deadline, 0) from exc
        return _health(status, body)

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
