"""Same-host regions, per endpoint: what the service's /health offers, its region socket reached
and checked, and when to ask again. A service still starting offers none yet, and one that
restarted closed the socket its regions were registered on: neither answer stands for the
client's lifetime. Nor does a region refused for a call (the user's byte budget spent, ...):
calls go over TCP a while, then try regions again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..errors import ProtocolError, SharedMemoryUnavailableError
from ..regions.connection import RegionConnection, RegionSet
from ._answers import Bytes, health_json

__all__ = ["RECHECK_NONE_S", "RECHECK_REFUSED_S", "RECHECK_STARTING_S", "Offer", "offered"]

#: how long "no regions" stands when the service was not ready (starting, draining)
RECHECK_STARTING_S = 1.0
#: how long it stands when a ready service offered none, or none this host can reach
RECHECK_NONE_S = 30.0
#: how long calls pass over the regions after a region was refused for one: each try costs a
#: region made and populated here (16 MiB at least) before the service says no
RECHECK_REFUSED_S = 1.0


@dataclass
class Offer:
    """An endpoint's regions (None: not used), until when a None stands, and until when calls
    pass over regions that are there (a region was refused for one). The client's lock over its
    offers guards each."""

    regions: RegionSet | None
    until: float = math.inf  # time.monotonic()
    refused_until: float = 0.0  # time.monotonic()

    def for_calls(self) -> RegionSet | None:
        """`regions` for a call now: None while a refusal stands (`refused`)."""
        return None if time.monotonic() < self.refused_until else self.regions

    def refused(self) -> None:
        """A region for a call could not be had: calls go without regions for a while."""
        self.refused_until = time.monotonic() + RECHECK_REFUSED_S

    def current(self) -> bool:
        """Still the answer: regions whose socket is open, or a None not yet due to be asked
        again. Regions whose socket closed (the service restarted, or an exchange failed) are
        closed here: the service forgot them with the connection."""
        if self.regions is None:
            return time.monotonic() < self.until
        if self.regions.connection.closed:
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
        client = RegionConnection(str(offer["socket"]), token, timeout)
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
