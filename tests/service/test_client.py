"""The client against real servers: several endpoints, an unreachable one, errors mapped."""

from __future__ import annotations

import pytest
import torch

import zen_mla
from tests.service.conftest import free_port
from tests.test_attention import BATCH_SPECS, make_batch
from zen_mla.client import PrefillClient, _Balancer


def test_least_outstanding_work_wins():
    bal = _Balancer(3)
    bal.begin(0, 100)
    bal.begin(1, 10)
    assert bal.pick(set()) == 2
    bal.begin(2, 50)
    assert bal.pick(set()) == 1
    assert bal.pick({1}) == 2  # passed over after a failure there
    bal.down(1)
    bal.end(0, 100)
    assert bal.pick(set()) == 0
    bal.end(2, 50)
    assert bal.pick(set()) in (0, 2)  # 1 is down for a while, even though idle


def test_equal_load_rotates():
    bal = _Balancer(2)
    assert {bal.pick(set()) for _ in range(4)} == {0, 1}


def test_an_unreachable_endpoint_is_passed_over(server):
    dead = f"http://127.0.0.1:{free_port()}"
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 32), torch.bfloat16)
    want = zen_mla.ragged_attention(q, k, v, q_cu)
    with PrefillClient([dead, server.url]) as client:
        for _ in range(4):
            assert torch.equal(client.prefill(q, k, v, q_cu), want)
        assert client._balancer.down_until[0] > 0


def test_all_endpoints_unreachable_is_service_unavailable():
    with PrefillClient([f"http://127.0.0.1:{free_port()}"], retries=1) as client:
        q = torch.randn(4, 1, 8)
        with pytest.raises(zen_mla.ServiceUnavailableError, match="unreachable"):
            client.prefill(q, q, q, torch.tensor([0, 4]))
