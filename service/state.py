"""What the service holds while it runs: its engine, its regions, its admission, its metrics."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

from zen_mla.engine import PrefillEngine
from zen_mla.regions.registry import RegionRegistry
from zen_mla.regions.server import RegionServer

from .admission import Admission
from .kserve.system_shm import SystemShmRegistry
from .metrics import Metrics
from .settings import Settings

__all__ = ["ServiceState"]


@dataclass
class ServiceState:
    settings: Settings
    engine: PrefillEngine | None = None
    ready: bool = False
    draining: bool = False
    start_error: str | None = None
    # zentorch_status(), once its probe (seconds, in a thread at start) is done; /health reads
    # this instead of calling it, which would block the event loop on the probe meanwhile
    zentorch: dict[str, Any] | None = None
    # same-host regions (None while shared memory is off or not started); owned by the event
    # loop's thread, as the region server that fills it runs there
    regions: RegionRegistry | None = None
    region_server: RegionServer | None = None
    # the Open Inference Protocol's system shared memory (None while off or not started)
    system_shm: SystemShmRegistry | None = None
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    metrics: Metrics = field(default_factory=Metrics)
    admission: Admission = field(init=False)
    # work whose client hung up, running on to its end (`_abandon`); owned by the event loop
    abandoned: set[asyncio.Future[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.admission = Admission(self.settings)

    @property
    def inflight(self) -> int:
        """Requests admitted and not answered: bodies being read, queued or computing."""
        return self.admission.inflight
