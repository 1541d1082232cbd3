"""The client against a real server (tests/service/servers.py): an unreachable endpoint beside
it is passed over. Its choice of endpoint without a server is in tests/client/test_endpoints.py.
Slow: it starts a server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import zen_mla
from tests.batches import BATCH_SPECS, make_batch
from tests.service.servers import Server, free_port, serve, server_fixture
from zen_mla.client import PrefillClient

pytestmark = pytest.mark.slow


@server_fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("server"), workers=1) as s:
        yield s


def test_an_unreachable_endpoint_is_passed_over(server):
    dead = f"http://127.0.0.1:{free_port()}"
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 32), torch.bfloat16)
    want = zen_mla.ragged_attention(q, k, v, q_cu)
    with PrefillClient([dead, server.url]) as client:
        for _ in range(4):
            assert torch.equal(client.prefill(q, k, v, q_cu), want)
        assert client._balancer.at(0).down  # until it answers /health/ready
