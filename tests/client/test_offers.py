"""When a client asks a service again for its same-host regions (`zen_mla.client._offers`): a
service still starting offers none yet, so that "none" stands a second; a ready one that offers
none, half a minute; regions whose socket closed (the service restarted) are not current and are
closed. A real RegionServer in this process; /health bodies as the service writes them."""

from __future__ import annotations

import json
import time

import pytest

import zen_mla
from tests.regions.region_sockets import running
from zen_mla.client import _offers as offers
from zen_mla.regions.protocol import call_fields


def _health(status: str, socket: str | None, instance: str = "x") -> bytes:
    shared = None if socket is None else {"socket": socket, "instance": instance}
    return json.dumps({"status": status, "shared_memory": shared}).encode()


def test_a_service_still_starting_is_asked_again_within_a_second(tmp_path):
    t0 = time.monotonic()
    offer = offers.offered(503, _health("starting", None), None, 5, False)
    assert offer.regions is None and offer.current()
    assert offer.until - t0 == pytest.approx(offers.RECHECK_STARTING_S, abs=0.5)
    offer.until = time.monotonic() - 0.01  # the second passed
    assert not offer.current()  # asked again: now it offers them
    with running(tmp_path) as r:
        again = offers.offered(200, _health("ok", r.server.path), None, 5, False)
        assert again.regions is not None and again.current()
        again.regions.close()


def test_a_ready_service_that_offers_none_is_asked_again_later():
    t0 = time.monotonic()
    offer = offers.offered(200, _health("ok", None), None, 5, False)
    assert offer.regions is None and offer.current()
    assert offer.until - t0 == pytest.approx(offers.RECHECK_NONE_S, abs=0.5)
    unreachable = offers.offered(200, _health("ok", "/nonexistent/zen.sock"), None, 5, False)
    assert unreachable.regions is None
    assert unreachable.until - t0 == pytest.approx(offers.RECHECK_NONE_S, abs=0.5)
    not_json = offers.offered(502, b"<html>bad gateway</html>", None, 5, False)
    assert not_json.regions is None
    assert not_json.until - t0 == pytest.approx(offers.RECHECK_STARTING_S, abs=0.5)


def test_required_regions_that_cannot_be_had_raise(tmp_path):
    with pytest.raises(zen_mla.SharedMemoryUnavailableError, match="offers no shared memory"):
        offers.offered(503, _health("starting", None), None, 5, True)
    with (
        running(tmp_path) as r,
        pytest.raises(zen_mla.SharedMemoryUnavailableError, match="another"),
    ):
        offers.offered(200, _health("ok", r.server.path, instance="y"), None, 5, True)


def test_regions_whose_socket_closed_are_not_current_and_are_closed(tmp_path):
    with running(tmp_path) as r:
        offer = offers.offered(200, _health("ok", r.server.path), None, 5, False)
        assert offer.regions is not None and offer.current()
        client = offer.regions.connection
        r.on_loop(r.server.close)  # the service went away (a restart): its socket closed
        with pytest.raises(zen_mla.SharedMemoryUnavailableError):
            client.try_call(call_fields({"body": "{}"}), 5)  # the next call finds it gone
        assert client.closed
        assert not offer.current()
