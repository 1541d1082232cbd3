"""uvicorn, with a drain on the first SIGTERM/SIGINT: new requests get 503 while in-flight ones
finish (up to the drain timeout), then the usual shutdown; a second signal exits at once."""

from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn

from .app import ServiceState, create_app
from .settings import Settings

log = logging.getLogger("zen_mla.service")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServiceState) -> None:
        super().__init__(config)
        self.state = state
        self.drain_started: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_started is None and not self.should_exit:
            # runs in a signal handler: set flags only, on_tick does the rest
            self.drain_started = time.monotonic()
            self.state.draining = True
            log.info("draining: %d requests in flight", self.state.inflight)
            return
        self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            waited = time.monotonic() - self.drain_started
            if self.state.inflight == 0 or waited > self.state.settings.drain_timeout_s:
                self.should_exit = True
        return await super().on_tick(counter)


def build_server(settings: Settings) -> DrainingServer:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        uds=settings.uds,
        http=settings.http,
        loop="uvloop",
        log_level=settings.log_level,
        # the pool drains itself; uvicorn's own wait only covers sending the last bytes
        timeout_graceful_shutdown=5,
        access_log=False,  # one structured line per request comes from the app instead
    )
    return DrainingServer(config, app.state.service)
