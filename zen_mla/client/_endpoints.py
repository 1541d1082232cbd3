"""A client's endpoints and which one a call goes to: the least loaded by outstanding work (a
request's weight: `weigh`), passing over one that failed until it answers `GET /health/ready`
with 200 again (`Balancer`). An endpoint is a URL as given, or one address of a name in it
(`_names`): each is an `Endpoint`, an object of its own that the balance, the calls on it, its
HTTP client and its same-host regions hold on to while the set of endpoints changes."""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any, Generic, TypeVar

import httpx
import torch

from ..attention.batch import total_visible_pairs
from ._offers import Offer

__all__ = [
    "LONG_DOWN",
    "PROBES_AT_ONCE",
    "PROBE_FIRST",
    "PROBE_LONG_MAX",
    "PROBE_MAX",
    "PROBE_RATE",
    "Balancer",
    "Endpoint",
    "weigh",
    "where",
]

PROBE_FIRST = 0.25  # seconds from a failure to the first readiness probe of the endpoint
PROBE_MAX = 2.0  # seconds, at most, between two probes of an endpoint down less than LONG_DOWN
LONG_DOWN = 60.0  # seconds down after which an endpoint's probes thin out to PROBE_LONG_MAX
PROBE_LONG_MAX = 30.0  # seconds, at most, between two probes of an endpoint down longer
PROBES_AT_ONCE = 8  # probes in flight at most, all endpoints together
PROBE_RATE = 50.0  # probes started a second at most, all endpoints together (past a burst of 8)

H = TypeVar("H")  # the twin's HTTP client: httpx.Client or httpx.AsyncClient


def weigh(q: torch.Tensor, q_cu: torch.Tensor, kv_cu: torch.Tensor | None, causal: bool) -> int:
    """A request's weight for balancing: heads x visible (query, key) pairs (of tensors as
    `_inputs.checked_tensors` checked them: q 3-D, cu_seq_lens 1-D integers)."""
    qc = q_cu.tolist()
    kc = kv_cu.tolist() if kv_cu is not None else qc
    return int(q.shape[1]) * total_visible_pairs(qc, kc, causal)


class Endpoint(Generic[H]):
    """One place calls go: the URL `source` as given, or one `address` of the name in it, which
    `http` (the twin's client, made for `where(source, address)`) then connects to,
    the name staying the Host header's and the TLS server name (`extensions`). Its balance
    (`outstanding` work, `calls`, `down`, the next probe) is guarded by the Balancer's lock;
    `offer`, its regions, by `asking` (the twin's lock, held while they are asked for)."""

    def __init__(self, source: str, address: str | None, http: H, asking: Any = None) -> None:
        self.source, self.address, self.http, self.asking = source, address, http, asking
        url = httpx.URL(source)
        tls_name = address is not None and url.scheme == "https"
        self.extensions = {"sni_hostname": url.host} if tls_name else {}
        self.outstanding = 0  # work of the calls on it
        self.picked = 0  # when it was last picked (Balancer's count): of equals, the longest ago
        self.calls = 0  # calls and exchanges on it (its HTTP client is closed only without)
        self.down = False  # left out until a probe's 200
        self.down_since = 0.0  # time.monotonic() when it went down
        self.probe_at = 0.0  # time.monotonic() of its next probe, while down
        self.probe_wait = PROBE_FIRST
        self.probing = False
        self.retired = False  # gone from the name's addresses: no new calls, closed once idle
        self.offer: Offer | None = None

    @property
    def name(self) -> str:
        """How errors name it."""
        return self.source if self.address is None else f"{self.address} of {self.source}"

    def __repr__(self) -> str:
        state = "retired" if self.retired else "down" if self.down else "up"
        return f"<Endpoint {self.name} {state}>"


def where(source: str, address: str | None) -> tuple[httpx.URL, dict[str, str]]:
    """The base URL an endpoint connects to, and its headers: `source` with `address` in place
    of its host (scheme, port and path as they are) and the name's Host header."""
    url = httpx.URL(source)
    if address is None:
        return url, {}
    return url.copy_with(host=address), {"Host": url.netloc.decode("ascii")}


class Balancer(Generic[H]):
    """The endpoints calls go to now (`endpoints`, in order) and their balance: `pick` gives
    the least loaded one not down (of equals, the one picked longest ago: with fewer calls in
    flight than endpoints, they take turns, however fast each answers); where every one is
    down, the least loaded of all. The endpoints down wait for their probes in a queue by
    time (`due`), so neither picking nor probing looks at every endpoint down on each call.
    Its lock guards the endpoints' balance, the list, those up and the probes' queue (calls in
    several threads share a client)."""

    def __init__(self, endpoints: list[Endpoint[H]]) -> None:
        self.endpoints = endpoints
        self._up = list(endpoints)  # those not down, in order
        self._retired: list[Endpoint[H]] = []  # not yet closed
        self._lock = threading.Lock()
        self._turn = itertools.count(1)
        # (probe_at, turn, endpoint) of the endpoints down; an entry whose endpoint is up again,
        # retired, or given another probe_at since is passed over when it comes up
        self._queue: list[tuple[float, int, Endpoint[H]]] = []
        self._probing = 0  # probes in flight
        self._tokens = float(PROBES_AT_ONCE)  # probes that may start now (PROBE_RATE refills)
        self._filled = time.monotonic()
        self._pid = os.getpid()  # of the process whose threads probe (a fork's child has none)

    def pick(self, tried: Collection[Endpoint[H]]) -> Endpoint[H]:
        with self._lock:
            pool = [e for e in self._up if e not in tried]
            if not pool:
                pool = [e for e in self.endpoints if e not in tried] or self._up or self.endpoints
            ep = min(pool, key=lambda e: (e.outstanding, e.picked))
            ep.picked = next(self._turn)
            return ep

    def at(self, i: int) -> Endpoint[H]:
        with self._lock:
            return self.endpoints[i]

    def begin(self, ep: Endpoint[H], work: int) -> None:
        with self._lock:
            ep.outstanding += work
            ep.calls += 1

    def end(self, ep: Endpoint[H], work: int) -> None:
        with self._lock:
            ep.outstanding -= work
            ep.calls -= 1

    def down(self, ep: Endpoint[H], probe_in: float = PROBE_FIRST) -> None:
        """`ep` failed (or is new): no work goes to it (while another is up) until a probe's
        200, the first `probe_in` seconds from now."""
        with self._lock:
            if ep.down:
                return
            now = time.monotonic()
            ep.down, ep.down_since, ep.probe_wait = True, now, PROBE_FIRST
            if ep in self._up:
                self._up.remove(ep)
            self._queue_probe(ep, now + probe_in)

    def _queue_probe(self, ep: Endpoint[H], at: float) -> None:
        ep.probe_at = at
        heapq.heappush(self._queue, (at, next(self._turn), ep))

    def due(self) -> list[Endpoint[H]]:
        """The endpoints down whose probe is due, earliest first, marked as being probed: the
        caller probes each and reports with `probed`. At most `PROBES_AT_ONCE` in flight and
        `PROBE_RATE` a second: the others wait their turn in the queue. None of a lone
        endpoint: it takes every call anyway."""
        now = time.monotonic()
        with self._lock:
            if self._pid != os.getpid():  # forked: the probes under way stayed with the parent
                self._forked()
            if not self._queue or self._queue[0][0] > now or len(self.endpoints) < 2:
                return []
            self._tokens = min(
                float(PROBES_AT_ONCE), self._tokens + (now - self._filled) * PROBE_RATE
            )
            self._filled = now
            due: list[Endpoint[H]] = []
            while self._queue and self._queue[0][0] <= now:
                if self._probing >= PROBES_AT_ONCE or self._tokens < 1:
                    break
                at, _, ep = heapq.heappop(self._queue)
                if not ep.down or ep.retired or ep.probing or at != ep.probe_at:
                    continue  # up again, gone, or queued anew since
                ep.probing = True
                self._probing += 1
                self._tokens -= 1
                due.append(ep)
            return due

    def _forked(self) -> None:
        self._pid = os.getpid()
        self._probing = 0
        for ep in self.endpoints:
            if ep.probing:
                ep.probing = False
                self._queue_probe(ep, ep.probe_at)

    def probed(self, ep: Endpoint[H], ready: bool) -> None:
        """A probe of `ep` ended: up again where it answered 200, else probed again later
        (waits doubling from `PROBE_FIRST` to `PROBE_MAX`, and on to `PROBE_LONG_MAX` once
        down `LONG_DOWN` seconds)."""
        with self._lock:
            if not ep.probing:
                return  # a probe of the parent's, ended in a forked child
            ep.probing = False
            self._probing -= 1
            now = time.monotonic()
            if ready:
                ep.down = False
                self._up = [e for e in self.endpoints if not e.down]
            elif not ep.retired:
                cap = PROBE_MAX if now - ep.down_since < LONG_DOWN else PROBE_LONG_MAX
                ep.probe_wait = min(ep.probe_wait * 2, cap)
                self._queue_probe(ep, now + ep.probe_wait)

    def untried_sibling(self, ep: Endpoint[H], tried: Collection[Endpoint[H]]) -> bool:
        """Whether another address of `ep`'s name is yet to be tried by the call."""
        with self._lock:
            return any(
                e.source == ep.source and e is not ep and e not in tried for e in self.endpoints
            )

    def of(self, source: str) -> list[Endpoint[H]]:
        with self._lock:
            return [e for e in self.endpoints if e.source == source]

    def place(self, source: str, endpoints: Iterable[Endpoint[H]]) -> None:
        """`source`'s endpoints from now on, in place of those it had (kept where given again,
        retired where not: closed once no call is on them, `idle`). The block of
        `source`'s endpoints stays where it was in the order."""
        with self._lock:
            new = list(endpoints)
            block = [e for e in self.endpoints if e.source == source]
            at = self.endpoints.index(block[0]) if block else len(self.endpoints)
            rest = [e for e in self.endpoints if e.source != source]
            self.endpoints = rest[:at] + new + rest[at:]
            self._up = [e for e in self.endpoints if not e.down]
            for ep in block:
                if ep not in new:
                    ep.retired = True
                    self._retired.append(ep)

    def idle(self) -> list[Endpoint[H]]:
        """Retired endpoints no call is on any more, handed over once: to be closed."""
        with self._lock:
            idle = [e for e in self._retired if e.calls == 0]
            self._retired = [e for e in self._retired if e.calls]
            return idle

    def everything(self) -> list[Endpoint[H]]:
        """Every endpoint not yet closed, retired ones too, handed over: the client closes."""
        with self._lock:
            every, self._retired = self.endpoints + self._retired, []
            return every

    def __len__(self) -> int:
        """How many endpoints."""
        return len(self.endpoints)
