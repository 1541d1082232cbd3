"""The client without a server: which endpoint it picks, when one that failed gets work again,
the endpoints a name's addresses make, and none of them reachable. Beside a real server:
tests/client/test_endpoints_served.py; names served by real replicas:
tests/client/test_names_served.py."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

import zen_mla
from tests.service.servers import free_port
from zen_mla.client import PrefillClient
from zen_mla.client._deadline import Deadline
from zen_mla.client._endpoints import PROBE_FIRST, PROBE_MAX, Balancer, Endpoint, where
from zen_mla.client._retry import failover

NAME_URL = "http://replicas.example:8000/base"


def endpoints(n: int, source: str = NAME_URL) -> list[Endpoint[None]]:
    return [Endpoint(source, f"10.0.0.{i}", None) for i in range(n)]


def test_least_outstanding_work_wins():
    eps = endpoints(3)
    bal = Balancer(eps)
    bal.begin(eps[0], 100)
    bal.begin(eps[1], 10)
    assert bal.pick(set()) is eps[2]
    bal.begin(eps[2], 50)
    assert bal.pick(set()) is eps[1]
    assert bal.pick({eps[1]}) is eps[2]  # passed over after a failure there
    bal.down(eps[1])
    bal.end(eps[0], 100)
    assert bal.pick(set()) is eps[0]
    bal.end(eps[2], 50)
    assert bal.pick(set()) in (eps[0], eps[2])  # 1 is down, even though idle


def test_equal_load_rotates():
    eps = endpoints(2)
    bal = Balancer(eps)
    assert {bal.pick(set()) for _ in range(4)} == set(eps)


def test_one_down_gets_no_work_until_its_probe_says_ready():
    eps = endpoints(2)
    bal = Balancer(eps)
    bal.down(eps[0])
    assert bal.due() == []  # its first probe waits a moment
    assert all(bal.pick(set()) is eps[1] for _ in range(10))
    eps[0].probe_at = 0.0
    assert bal.due() == [eps[0]]
    assert bal.due() == []  # being probed
    bal.probed(eps[0], ready=False)
    assert eps[0].down and eps[0].probe_wait == 2 * PROBE_FIRST
    assert eps[0].probe_at > time.monotonic()
    for _ in range(10):
        bal.probed(eps[0], ready=False)
    assert eps[0].probe_wait == PROBE_MAX
    bal.probed(eps[0], ready=True)
    assert {bal.pick(set()) for _ in range(4)} == set(eps)


def test_every_endpoint_down_is_tried_anyway():
    eps = endpoints(2)
    bal = Balancer(eps)
    for ep in eps:
        bal.down(ep)
    assert bal.pick({eps[0]}) is eps[1]


def test_a_vanished_address_is_closed_once_its_calls_end():
    eps = endpoints(3)
    other = Endpoint("http://10.9.9.9:8000", None, None)
    bal = Balancer([other, *eps])
    bal.begin(eps[0], 5)
    fresh = Endpoint(NAME_URL, "10.0.0.7", None)
    bal.place(NAME_URL, [eps[1], eps[2], fresh])
    assert bal.endpoints == [other, eps[1], eps[2], fresh]  # the name's block where it was
    assert eps[0].retired and bal.idle() == []  # a call is on it
    assert all(bal.pick(set()) is not eps[0] for _ in range(6))
    bal.end(eps[0], 5)
    assert bal.idle() == [eps[0]]
    assert bal.idle() == []  # handed over once


def test_an_address_stands_in_for_the_name_it_was_found_for():
    url, headers = where("https://replicas.example:8443/zen", "10.0.0.5")
    assert str(url) == "https://10.0.0.5:8443/zen"
    assert headers == {"Host": "replicas.example:8443"}
    assert Endpoint("https://replicas.example:8443/zen", "10.0.0.5", None).extensions == {
        "sni_hostname": "replicas.example"
    }
    assert str(where("http://replicas.example/", "fd00::5")[0]) == "http://[fd00::5]/"
    assert where(NAME_URL, None) == (httpx.URL(NAME_URL), {})
    assert Endpoint("http://replicas.example", "10.0.0.5", None).extensions == {}


@pytest.mark.parametrize(
    "exc",
    [
        httpx.ConnectError("refused"),
        httpx.ConnectTimeout("no SYN-ACK"),
        zen_mla.ServiceUnavailableError("the service is starting"),
    ],
)
def test_an_address_that_served_nothing_fails_over_to_its_siblings_as_no_retry(exc):
    eps = endpoints(2)
    lone = Endpoint("http://10.9.9.9:8000", None, None)
    bal = Balancer([*eps, lone])
    tried: set[Endpoint[None]] = set()
    deadline = Deadline(10.0)
    assert failover(exc, eps[0], tried, bal, deadline)
    assert eps[0].down and tried == {eps[0]}
    assert not failover(exc, eps[1], tried, bal, deadline)  # no sibling left: a retry's turn
    assert eps[1].down
    assert not failover(exc, lone, set(), bal, deadline)  # a URL alone has no sibling


@pytest.mark.parametrize(
    "exc", [httpx.ReadError("reset"), zen_mla.QueueFullError("full"), httpx.ReadTimeout("slow")]
)
def test_a_failure_the_endpoint_may_have_served_is_no_failover(exc):
    eps = endpoints(2)
    bal = Balancer(eps)
    assert not failover(exc, eps[0], set(), bal, Deadline(10.0))
    assert not eps[0].down  # next_step decides (a reset: down, and a retry's turn)


def test_ip_literals_and_unix_sockets_are_not_looked_up():
    urls = ["http://127.0.0.1:1", "http://[::1]:1"]
    with PrefillClient(urls) as client:
        assert client._lookups.urls == []
    with PrefillClient("http://zen-mla", uds="/nonexistent.sock") as client:
        assert client._lookups.urls == []
    with PrefillClient(["http://127.0.0.1:1", "http://zen-mla.example:1"]) as client:
        assert client._lookups.urls == ["http://zen-mla.example:1"]
    with pytest.raises(zen_mla.InvalidInputError, match="resolve_every"):
        PrefillClient("http://127.0.0.1:1", resolve_every=0)


def test_all_endpoints_unreachable_is_service_unavailable():
    with PrefillClient([f"http://127.0.0.1:{free_port()}"], retries=1) as client:
        q = torch.randn(4, 1, 8)
        with pytest.raises(zen_mla.ServiceUnavailableError, match="unreachable"):
            client.prefill(q, q, q, torch.tensor([0, 4]))
