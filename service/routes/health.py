"""`GET /health` (readiness, with what the host and the workers are), `/health/ready` (the
same, in short), `/health/live` and
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
        """Readiness: the host's kernels (what "auto" takes and why), each worker, what is held."""
        return _health(state)

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get(
        "/health/ready", responses={503: {"description": "not ready, draining, or no worker alive"}}
    )
    async def ready() -> JSONResponse:
        """200 while the service takes work, else 503: what a balancer asks before it sends a
        replica work again (`/health` says why, at more length)."""
        now = readiness(state)
        return JSONResponse({"status": now.status}, status_code=200 if now.ready else 503)

    app.add_api_route("/health/ready", ready, methods=["HEAD"], include_in_schema=False)

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
    """200 ("ok", or "degraded" while some worker is down) only when a worker can take work.

    `kernels` is `zen_mla.host_kernels()`; `zentorch`, `kernel`, `kernel_reason`, `lse_kernel`,
    `lse_kernel_reason` and `kernel_calibration` are the same facts under their earlier keys,
    kept for clients that read them (deprecated; removed in 0.3)."""
    now = readiness(state)
    a = state.admission
    kernels = state.kernels
    auto = kernels["auto"] if kernels is not None else None
    body = {
        "status": now.status,
        "kernels": kernels,
        "shared_memory": (
            {"socket": state.region_server.path, "instance": state.instance}
            if state.region_server is not None
            else None
        ),
        "cpu": kernels["cpu"] if kernels is not None else None,
        "workers": now.workers,
        "inflight": a.inflight,
        "uploads": a.uploads,
        "queued": a.queued,
        "inflight_bytes": a.inflight_bytes,
        "held_bytes": {kind: a.held_bytes[kind] for kind in HELD_KINDS},
        "error": state.start_error,
        # deprecated keys: the facts of `kernels`, as clients read them before it
        "zentorch": (
            kernels["zentorch"]
            if kernels is not None
            else {"installed": None, "version": None, "ops": None}
        ),
        "kernel": auto and auto["out"]["kernel"],
        "kernel_reason": auto and auto["out"]["reason"],
        "lse_kernel": auto and auto["lse"]["kernel"],
        "lse_kernel_reason": auto and auto["lse"]["reason"],
        "kernel_calibration": auto and {m: auto[m]["calibration"] for m in ("out", "lse")},
    }
    return JSONResponse(body, status_code=200 if now.ready else 503)
