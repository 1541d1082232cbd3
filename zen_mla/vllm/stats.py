"""How many MLA prefill calls this process sent to the service and computed itself:
`zen_mla.vllm.stats`."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["Stats", "StatsSnapshot", "stats"]


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """Calls since the process started: `remote` answered by the service, `local` computed in
    this process (in-process mode, `ZEN_MLA_URL=local`; or the service could not take it:
    `fallback`), `outages` times a link went down, `latent` context chunks attended from the
    latent cache (`cpu_mla`; each counted in `remote` or `local` too, where it ran)."""

    remote: int
    local: int
    outages: int
    latent: int = 0


class Stats:
    """The counters of this process (`zen_mla.vllm.stats`); `_lock` guards them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._remote = self._local = self._outages = self._latent = 0

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(self._remote, self._local, self._outages, self._latent)

    def add(self, remote: int = 0, local: int = 0, outages: int = 0, latent: int = 0) -> None:
        with self._lock:
            self._remote += remote
            self._local += local
            self._outages += outages
            self._latent += latent


stats = Stats()
