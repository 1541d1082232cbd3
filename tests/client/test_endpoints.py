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
from zen_mla.client._endpoints import (
    LONG_DOWN,
    PROBE_FIRST,
    PROBE_LONG_MAX,
    PROBE_MAX,
    PROBES_AT_ONCE,
    Balancer,
    Endpoint,
    where,
)
from zen_mla.client._retry import failover, next_step

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


def probe_failed(bal: Balancer[None], ep: Endpoint[None]) -> None:
    """`ep`'s next probe made at once (a second later, for the rate), and not ready."""
    bal._queue_probe(ep, 0.0)
    bal._filled -= 1.0
    assert bal.due() == [ep]
    bal.probed(ep, ready=False)


def test_one_down_gets_no_work_until_its_probe_says_ready():
    eps = endpoints(2)
    bal = Balancer(eps)
    bal.down(eps[0])
    assert bal.due() == []  # its first probe waits a moment
    assert all(bal.pick(set()) is eps[1] for _ in range(10))
    time.sleep(PROBE_FIRST)
    assert bal.due() == [eps[0]]
    assert bal.due() == []  # being probed
    bal.probed(eps[0], ready=False)
    assert eps[0].down and eps[0].probe_wait == 2 * PROBE_FIRST
    assert eps[0].probe_at > time.monotonic()
    for _ in range(10):
        probe_failed(bal, eps[0])
    assert eps[0].probe_wait == PROBE_MAX
    eps[0].down_since -= LONG_DOWN  # down a long time: its probes thin out further
    for _ in range(10):
        probe_failed(bal, eps[0])
    assert eps[0].probe_wait == PROBE_LONG_MAX
    assert all(bal.pick(set()) is eps[1] for _ in range(10))
    bal.down(eps[1])  # all down: tried anyway, the least loaded
    bal.begin(eps[1], 5)
    assert bal.pick(set()) is eps[0]
    bal.end(eps[1], 5)
    bal._queue_probe(eps[0], 0.0)
    bal._filled -= 1.0
    assert bal.due() == [eps[0]]
    bal.probed(eps[0], ready=True)
    assert not eps[0].down
    assert all(bal.pick(set()) is eps[0] for _ in range(4))


def test_many_down_are_probed_a_few_at_a_time():
    """A thousand addresses down at once: at most PROBES_AT_ONCE probes in flight, started at
    most PROBE_RATE a second, earliest due first; none looked at while none is due."""
    eps = endpoints(1000)
    bal = Balancer(eps)
    for ep in eps[1:]:
        bal.down(ep, probe_in=0.0)
    first = bal.due()
    assert first == eps[1 : 1 + PROBES_AT_ONCE]
    assert bal.due() == []  # every slot in flight
    for ep in first:
        bal.probed(ep, ready=False)
    bal._filled -= 1.0  # a second on: PROBE_RATE more may start, PROBES_AT_ONCE at once
    assert bal.due() == eps[1 + PROBES_AT_ONCE : 1 + 2 * PROBES_AT_ONCE]
    assert all(bal.pick(set()) is eps[0] for _ in range(10))


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


@pytest.mark.parametrize(
    "exc", [httpx.ConnectTimeout("no SYN-ACK"), httpx.ReadTimeout("no answer")]
)
def test_an_endpoint_the_deadline_passed_on_is_left_out_before_the_error(exc):
    eps = endpoints(2)
    bal = Balancer(eps)
    past = Deadline(0.0)
    assert not failover(exc, eps[0], set(), bal, past)  # no time to go on
    with pytest.raises(zen_mla.DeadlineExceededError):
        next_step(exc, eps[0], set(), 0, 3, bal, past)
    assert eps[0].down
    assert all(bal.pick(set()) is eps[1] for _ in range(4))


def test_a_read_timeout_with_time_left_is_not_sent_again_but_left_out():
    eps = endpoints(2)
    bal = Balancer(eps)
    with pytest.raises(zen_mla.DeadlineExceededError, match="no answer in time"):
        next_step(httpx.ReadTimeout("slow"), eps[0], set(), 0, 3, bal, Deadline(10.0))
    assert eps[0].down


def test_a_connect_takes_its_share_of_what_the_call_has_left():
    deadline = Deadline(8.0)
    assert deadline.connect_timeout(5.0) == 5.0  # all of what is left, by default
    deadline.connect_share = 0.25
    assert 1.9 < (deadline.connect_timeout(5.0) or 0) <= 2.0
    assert deadline.connect_timeout(1.0) == 1.0
    assert 1.9 < (deadline.connect_timeout(None) or 0) <= 2.0
    assert Deadline(None).connect_timeout(3.0) == 3.0
    assert (Deadline(0.0).connect_timeout(3.0) or 0) <= 0


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
