"""The names in a client's URLs and the addresses they stand for. A host name that resolves to
several addresses (a Kubernetes headless Service: one A/AAAA record per ready pod) is balanced
over all of them: each address is an endpoint of its own (`_endpoints.Endpoint`). The names are
looked up with the system's resolver (`socket.getaddrinfo`) in a thread of their own, never
in a call's way (`Lookups`): first when the client is first used (that call waits for it a
moment, `FIRST_WAIT`), then again once `resolve_every` seconds have passed since the last,
on the next call. A name that fails to resolve keeps the addresses it had."""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import httpx

__all__ = ["FIRST_WAIT", "Found", "Lookups", "is_name", "resolve"]

logger = logging.getLogger("zen_mla.client")

#: seconds the first call waits for the first lookup (past them it goes to the name itself)
FIRST_WAIT = 2.0

#: per URL given with a name: its addresses, or None where the lookup failed
Found = dict[str, list[str] | None]


def is_name(url: str) -> bool:
    """Whether `url`'s host is a name to look up (not an IP literal)."""
    host = httpx.URL(url).host
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def resolve(url: str) -> list[str]:
    """The addresses `url`'s host name stands for now, as the system's resolver orders them,
    each once (socket.gaierror or OSError where it cannot say); IPv6 link-local ones with a
    zone (`fe80::1%eth0`) left out: a URL cannot carry the zone."""
    parsed = httpx.URL(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    found: list[str] = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(parsed.host, port, type=socket.SOCK_STREAM):
        address = str(sockaddr[0])
        usable = family in (socket.AF_INET, socket.AF_INET6) and "%" not in address
        if usable and address not in found:
            found.append(address)
    return found


def _look_up(urls: Sequence[str]) -> Found:
    found: Found = {}
    for url in urls:
        try:
            found[url] = resolve(url) or None
        except (OSError, UnicodeError) as exc:
            logger.debug("zen-mla client: %s did not resolve (%s); its addresses stand", url, exc)
            found[url] = None
    return found


class Lookups:
    """When a client's names are looked up, and the lookup under way (in a daemon thread; its
    result is taken by one of the client's calls, `take`)."""

    def __init__(self, urls: Sequence[str], every: float) -> None:
        self.urls = [u for u in urls if is_name(u)]
        self.every = every
        self.first = True  # no lookup taken yet
        self._due = 0.0  # time.monotonic()
        self._lock = threading.Lock()  # guards _due, _pending, first, _resolved
        self._pending: concurrent.futures.Future[Found] | None = None
        self._pid = os.getpid()  # of the process whose thread looks up (a fork's child has none)
        self._resolved: set[str] = set()  # URLs that resolved once

    def due(self) -> concurrent.futures.Future[Found] | None:
        """The lookup under way, started where one is due; None without names."""
        if not self.urls:
            return None
        with self._lock:
            if self._pid != os.getpid():  # forked: the lookup's thread stayed with the parent
                self._pid, self._pending = os.getpid(), None
            if self._pending is None and time.monotonic() >= self._due:
                pending: concurrent.futures.Future[Found] = concurrent.futures.Future()
                self._pending = pending

                def run() -> None:
                    try:
                        pending.set_result(_look_up(self.urls))
                    except BaseException as exc:  # never: _look_up keeps its errors
                        pending.set_exception(exc)

                threading.Thread(target=run, name="zen-mla-resolve", daemon=True).start()
            return self._pending

    def take(self) -> tuple[Found, bool] | None:
        """A finished lookup's addresses, to one caller only, and whether it is the first
        taken; None where none has finished."""
        with self._lock:
            pending = self._pending
            if pending is None or not pending.done():
                return None
            self._pending = None
            self._due = time.monotonic() + self.every
            first, self.first = self.first, False
            found = pending.result()
            for url, addresses in found.items():
                if addresses is None and url in self._resolved:
                    self._resolved.discard(url)  # said once, until it resolves again
                    logger.warning(
                        "zen-mla client: %s no longer resolves; its addresses stand", url
                    )
                elif addresses is not None:
                    self._resolved.add(url)
            return found, first
