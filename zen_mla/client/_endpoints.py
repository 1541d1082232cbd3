"""A client's endpoints and which one a call goes to: the least loaded by outstanding work (a
request's weight: `weigh`), passing over one that failed until it answers `GET /health/ready`
with 200 again (`Balancer`). An endpoint is a URL as given, or one address of a name in it
(`_names`): each is an `Endpoint`, an object of its own that the balance, the calls on it, its
HTTP client and its same-host regions hold on to while the set of endpoints changes."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Collection, Iterable
from typing import Generic, TypeVar

import httpx
import torch

from ..attention.batch import total_visible_pairs
from ._offers import Offer

__all__ = ["PROBE_FIRST", "PROBE_MAX", "Balancer", "Endpoint", "weigh", "where"]

PROBE_FIRST = 0.25  # seconds from a failure to the first readiness probe of the endpoint
PROBE_MAX = 2.0  # seconds, at most, between two probes of an endpoint still not ready

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
    `offer`, its regions, by the client's lock over them."""

    def __init__(self, source: str, address: str | None, http: H) -> None:
        self.source, self.address, self.http = source, address, http
        url = httpx.URL(source)
        tls_name = address is not None and url.scheme == "https"
        self.extensions = {"sni_hostname": url.host} if tls_name else {}
        self.outstanding = 0  # work of the calls on it
        self.picked = 0  # when it was last picked (Balancer's count): of equals, the longest ago
        self.calls = 0  # calls and exchanges on it (its HTTP client is closed only without)
        self.down = False  # left out until a probe's 200
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
    down, the least loaded of all. Its lock guards the endpoints' balance and the list (calls
    in several threads share a client)."""

    def __init__(self, endpoints: list[Endpoint[H]]) -> None:
        self.endpoints = endpoints
        self._retired: list[Endpoint[H]] = []  # not yet closed
        self._lock = threading.Lock()
        self._turn = itertools.count(1)
        self._pid = os.getpid()  # of the process whose threads probe (a fork's child has none)

    def pick(self, tried: Collection[Endpoint[H]]) -> Endpoint[H]:
        with self._lock:
            eps = self.endpoints
            n = len(eps)
            candidates = [i for i in range(n) if eps[i] not in tried] or list(range(n))
            up = [i for i in candidates if not eps[i].down] or candidates
            ep = eps[min(up, key=lambda i: (eps[i].outstanding, eps[i].picked))]
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

    def down(self, ep: Endpoint[H]) -> None:
        """`ep` failed: no work goes to it (while another is up) until a probe's 200."""
        with self._lock:
            if not ep.down:
                ep.down, ep.probe_wait = True, PROBE_FIRST
                ep.probe_at = time.monotonic() + PROBE_FIRST

    def due(self) -> list[Endpoint[H]]:
        """The endpoints down whose probe is due, marked as being probed: the caller probes
        each and reports with `probed`. None of a lone endpoint: it takes every call anyway."""
        now = time.monotonic()
        with self._lock:
            if len(self.endpoints) < 2:
                return []
            if self._pid != os.getpid():  # forked: the probes under way stayed with the parent
                self._pid = os.getpid()
                for ep in self.endpoints:
                    ep.probing = False
            due = [e for e in self.endpoints if e.down and not e.probing and e.probe_at <= now]
            for ep in due:
                ep.probing = True
            return due

    def probed(self, ep: Endpoint[H], ready: bool) -> None:
        """A probe of `ep` ended: up again where it answered 200, else probed again later."""
        with self._lock:
            ep.probing = False
            if ready:
                ep.down = False
            else:
                ep.probe_wait = min(ep.probe_wait * 2, PROBE_MAX)
                ep.probe_at = time.monotonic() + ep.probe_wait

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
