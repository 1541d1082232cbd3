"""Same-host regions, per endpoint: what the service's /health offers, its region socket reached
and checked, and when to ask again. A service still starting offers none yet, and one that
restarted closed the socket its regions were registered on: neither answer stands for the
client's lifetime.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..errors import ProtocolError, SharedMemoryUnavailableError
from ..regions.client import RegionClient, RegionSet
from ._answers import Bytes, health_json

__all__ = ["RECHECK_NONE_S", "RECHECK_STARTING_S", "Offer", "offered"]

#: how long "no regions" stands when the service was not ready (starting, draining)
RECHECK_STARTING_S = 1.0
#: how long it stands when a ready service offered none, or none this host can reach
RECHECK_NONE_S = 30.0


@dataclass
class Offer:
    """An endpoint's regions (None: not used), and until when a None stands."""

    regions: RegionSet | None
    until: float = math.inf  # time.monotonic()

    def current(self) -> bool:
        """Still the answer: regions whose socket is open, or a None not yet due to be asked
        again. Regions whose socket closed (the service restarted, or an exchange failed) are
        closed here: the service forgot them with the connection."""
        if self.regions is None:
            return time.monotonic() < self.until
        if self.regions.client.closed:
            self.regions.close()
            return False
        return True


def offered(status: int, body: Bytes, token: str | None, timeout: float, required: bool) -> Offer:
    """The same-host regions of the service whose /health answer this is, as an `Offer` (its
    `regions` None, standing a while, where they cannot be had; SharedMemoryUnavailableError
    instead when `required`). The region socket must answer with the instance /health names: a
    path that exists here may belong to another service than the one at this URL. Blocking: it
    connects to the region socket."""
    ready = False
    try:
        try:
            health = health_json(status, body)
        except ProtocolError as exc:
            raise SharedMemoryUnavailableError(f"no regions offered: {exc}") from exc
        ready = health.get("status") in ("ok", "degraded")
        offer = health.get("shared_memory")
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
        again = RECHECK_NONE_S if ready else RECHECK_STARTING_S
        return Offer(None, time.monotonic() + again)
    return Offer(RegionSet(client))
