"""`GET /health` (readiness, with what the host and the workers are), `/health/live` and
`/metrics` (Prometheus text)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from ..admission import HELD_KINDS
from ..state import ServiceState, readiness

__all__ = ["add_routes"]


def add_routes(app: FastAPI, state: ServiceState) -> None:
    @app.get("/health/live", include_in_schema=True)
    async def live() -> dict[str, str]:
        """200 while the process runs."""
        return {"status": "alive"}

    # HEAD answers as GET does, headers included; uvicorn sends no body for HEAD.
    app.add_api_route("/health/live", live, methods=["HEAD"], include_in_schema=False)

    @app.get("/health", responses={503: {"description": "not ready, draining, or no worker alive"}})
    async def health() -> JSONResponse:
        """Readiness: zentorch, the kernel "auto" resolves to, each worker."""
        return _health(state)

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text format, names prefixed zen_mla_."""
        workers = state.engine.workers() if state.engine is not None else []
        a = state.admission
        text = state.metrics.render(
            a.queued,
            a.uploads,
            sum(w["alive"] for w in workers),
            sum(w["restarts"] for w in workers),
            {kind: a.held_bytes[kind] for kind in HELD_KINDS},
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _health(state: ServiceState) -> JSONResponse:
    """200 ("ok", or "degraded" while some worker is down) only when a worker can take work."""
    status = state.zentorch or {}
    now = readiness(state)
    a = state.admission
    body = {
        "status": now.status,
        "zentorch": {k: status.get(k) for k in ("installed", "version", "ops")},
        "kernel": status.get("auto_kernel"),
        "kernel_reason": status.get("reason"),
        "lse_kernel": status.get("lse_kernel"),
        "lse_kernel_reason": status.get("lse_reason"),
        "kernel_calibration": status.get("calibration"),
        "shared_memory": (
            {"socket": state.region_server.path, "instance": state.instance}
            if state.region_server is not None
            else None
        ),
        "cpu": status.get("cpu"),
        "workers": now.workers,
        "inflight": a.inflight,
        "uploads": a.uploads,
        "queued": a.queued,
        "inflight_bytes": a.inflight_bytes,
        "held_bytes": {kind: a.held_bytes[kind] for kind in HELD_KINDS},
        "error": state.start_error,
    }
    return JSONResponse(body, status_code=200 if now.ready else 503)
