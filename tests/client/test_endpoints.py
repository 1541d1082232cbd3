"""The client without a server: which endpoint it picks, and none of them reachable. Beside a
real server: tests/client/test_endpoints_served.py."""

from __future__ import annotations

import pytest
import torch

import zen_mla
from tests.service.servers import free_port
from zen_mla.client import PrefillClient
from zen_mla.client._endpoints import Balancer


def test_least_outstanding_work_wins():
    bal = Balancer(3)
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
    bal = Balancer(2)
    assert {bal.pick(set()) for _ in range(4)} == {0, 1}


def test_all_endpoints_unreachable_is_service_unavailable():
    with PrefillClient([f"http://127.0.0.1:{free_port()}"], retries=1) as client:
        q = torch.randn(4, 1, 8)
        with pytest.raises(zen_mla.ServiceUnavailableError, match="unreachable"):
            client.prefill(q, q, q, torch.tensor([0, 4]))
