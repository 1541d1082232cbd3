"""What the service holds while it runs (`ServiceState`: its engine, regions, admission and
metrics), and the one readiness: whether it can take work now, and why not (`readiness`)."""

from __future__ import annotations

import asyncio
import functools
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from zen_mla import ServiceUnavailableError
from zen_mla.engine import PrefillEngine
from zen_mla.regions import RegionRegistry, RegionServer, SystemShmRegistry

from .admission import Admission
from .metrics import Metrics
from .settings import Settings
from .tenants import Tenants
from .weights import Weights

__all__ = ["Readiness", "ServiceState", "readiness"]


@dataclass
class ServiceState:
    settings: Settings
    engine: PrefillEngine | None = None
    ready: bool = False
    draining: bool = False
    start_error: str | None = None
    # host_kernels(), once its probes (seconds, in a thread at start) are done; /health reads
    # this instead of asking, which would block the event loop on the probes meanwhile
    kernels: dict[str, Any] | None = None
    # same-host regions (None while shared memory is off or not started); owned by the event
    # loop's thread, as the region server that fills it runs there
    regions: RegionRegistry | None = None
    region_server: RegionServer | None = None
    # the Open Inference Protocol's system shared memory (None while off or not started)
    system_shm: SystemShmRegistry | None = None
    # weights registered by callers (`weights`; None until the engine is up); the event loop's
    weights: Weights | None = None
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    metrics: Metrics = field(default_factory=Metrics)
    admission: Admission = field(init=False)
    tenants: Tenants = field(init=False)  # the tokens that open the service, whom each names
    # work whose client hung up, running on to its end (`compute._abandon`, and a gRPC call's
    # pipeline task whose handler grpc cancelled); owned by the event loop
    abandoned: set[asyncio.Future[Any]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.admission = Admission(self.settings)
        s = self.settings
        token = s.api_token.get_secret_value() if s.api_token is not None else None
        self.tenants = Tenants.from_settings(token, s.tenants_file)

    @property
    def inflight(self) -> int:
        """Requests admitted and not answered: bodies being read, queued or computing."""
        return self.admission.inflight


Status = Literal["ok", "degraded", "no_worker", "starting", "failed", "draining"]


class Readiness:
    """Whether the service can take work, and why not, as of `readiness(state)`. The workers are
    asked only when a caller needs them (`status`, `ready`, `workers`): asking takes each
    worker's lock and a waitpid, which the compute routes' gate (`admitting`) need not pay on
    every request."""

    def __init__(self, engine: PrefillEngine | None, phase: Status, reason: str | None) -> None:
        self._engine = engine
        self._phase = phase  # "ok" here: the engine runs; its workers are not asked yet
        self._reason = reason

    @functools.cached_property
    def workers(self) -> list[dict[str, Any]]:
        """The engine's workers, asked once."""
        return self._engine.workers() if self._engine is not None else []

    @property
    def status(self) -> Status:
        """/health's word: "ok", "degraded" (some worker down), "no_worker", "starting",
        "failed" or "draining"."""
        if self._phase != "ok":
            return self._phase
        alive = sum(bool(w["alive"]) for w in self.workers)
        if alive == 0:
            return "no_worker"
        return "degraded" if alive < len(self.workers) else "ok"

    @property
    def ready(self) -> bool:
        """A worker can take work now (/health and the /v2 readiness answer 200)."""
        return self.status in ("ok", "degraded")

    @property
    def admitting(self) -> bool:
        """Compute requests are let in: the engine runs and the service is not draining. With
        no worker alive they still are: the pool replaces dead workers and queued work waits
        for them (a worker killed mid-request is retried, not refused)."""
        return self._phase == "ok"

    def error(self, retry_after: float | None = None) -> ServiceUnavailableError:
        """The 503 that says why the service cannot take work."""
        reason = self._reason
        if reason is None and self.status == "no_worker":
            reason = "no worker is alive; they are being replaced"
        return ServiceUnavailableError(reason or "", retry_after)


def readiness(state: ServiceState) -> Readiness:
    """Whether the service can take work now, and why not: draining for shutdown, its engine
    failed or still starting, or no worker alive."""
    if state.draining:
        return Readiness(state.engine, "draining", "the service is draining for shutdown")
    if state.start_error:
        return Readiness(state.engine, "failed", state.start_error)
    if not state.ready or state.engine is None:
        return Readiness(state.engine, "starting", "the worker pool is starting")
    return Readiness(state.engine, "ok", None)
