"""A long-lived client (an orchestrator's) and a service that restarts under it: the client's
regions were registered on a connection the old service closed, so its next call asks /health
again and registers anew, and is answered correctly over the new service's region socket."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.batches import BATCH_SPECS, make_batch
from tests.reference import assert_close_to_reference
from tests.service.restart import requests_answered, serve_on
from tests.service.servers import free_port
from zen_mla.client import AsyncPrefillClient, PrefillClient

pytestmark = pytest.mark.slow


def test_a_client_keeps_using_regions_across_a_service_restart(tmp_path):
    port = free_port()
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (4, 192, 128), torch.bfloat16)
    with PrefillClient(f"http://127.0.0.1:{port}") as client:
        with serve_on(port, tmp_path / "server.log") as first:
            assert_close_to_reference(q, k, v, q_cu, None, True, client.prefill(q, k, v, q_cu))
            assert requests_answered(first, 1, ("socket",)) == 1
        with serve_on(port, tmp_path / "server.log") as second:
            for _ in range(3):
                out = client.prefill(q, k, v, q_cu)
                assert_close_to_reference(q, k, v, q_cu, None, True, out)
            # every one over the new region socket
            assert requests_answered(second, 3, ("socket",)) == 3
            regions = client.regions(0)
            assert regions is not None and not regions.connection.closed


def test_the_async_client_too(tmp_path):
    port = free_port()
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (4, 192, 128), torch.bfloat16)
    url = f"http://127.0.0.1:{port}"

    async def run() -> None:
        async with AsyncPrefillClient(url) as client:
            with serve_on(port, tmp_path / "server.log"):
                await client.prefill(q, k, v, q_cu)
            with serve_on(port, tmp_path / "server.log") as second:
                out = await client.prefill(q, k, v, q_cu)
                assert_close_to_reference(q, k, v, q_cu, None, True, out)
                assert requests_answered(second, 1, ("socket",)) == 1

    asyncio.run(run())
