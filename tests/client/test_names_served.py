"""One name for three real replicas (tests/client/replicas.py): `zen-mla serve` on 127.0.0.1,
127.0.0.2 and 127.0.0.3, one port, and the client in a process whose /etc/hosts (a private
mount namespace's) names all three; the real resolver's path, no mock. The calls spread evenly
over the three (as each replica's /metrics counts them), every answer is in-process
`ragged_attention`'s, a replica killed mid-run fails no call, and it gets work again only
after its `/health/ready` says 200; the hosts file rewritten, the client follows within its
re-resolve period. Slow: it starts servers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.client.replicas import ADDRESSES, NAME, Driver, Replicas, hosts_text, namespace_problem
from tests.processes import wait_for
from tests.service.servers import check_slow

pytestmark = pytest.mark.slow

CALLS = 150
TIMEOUT = 10.0  # the client's, seconds: a whole call's deadline


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    tmp = tmp_path_factory.mktemp("replicas")
    problem = namespace_problem(tmp)
    if problem:
        pytest.skip(f"no /etc/hosts of the client's own: {problem}")
    check_slow()
    replicas = Replicas(tmp)
    try:
        yield replicas.start()
    finally:
        replicas.close()


def driver(replicas: Replicas, addresses: tuple[str, ...], *options: str) -> Driver:
    hosts = replicas.tmp / "hosts"
    hosts.write_text(hosts_text(addresses))  # in place, once it is mounted
    url = f"http://{NAME}:{replicas.port}"
    return Driver(hosts, url, "--timeout", str(TIMEOUT), *options)


def answered_since(replicas: Replicas, before: list[int]) -> list[int]:
    return [now - then for now, then in zip(replicas.answered(), before, strict=True)]


def no_failures(summary: dict) -> None:
    assert summary["errors"] == {}, summary["errors"]
    assert summary["past_deadline"] == 0 and summary["max"] < TIMEOUT


@pytest.mark.parametrize("kind", ["sync", "async", "link"])
def test_calls_spread_evenly_over_the_addresses_of_a_name(replicas, kind):
    """Within 10% of an even share each; `link`: the vLLM link, ZEN_MLA_URL naming them."""
    client = driver(replicas, ADDRESSES, "--client", kind)
    try:
        found = {e["address"] for e in client.hello["endpoints"]}
        assert found == set(ADDRESSES)
        assert all(e["http"].startswith("http://127.0.0.") for e in client.hello["endpoints"])
        before = replicas.answered()
        summary = client.ask("run", calls=CALLS, threads=2)
    finally:
        client.close()
    no_failures(summary)
    assert summary["ok"] == CALLS  # each answer equal to in-process ragged_attention's
    got = answered_since(replicas, before)
    assert sum(got) == CALLS
    even = CALLS / len(ADDRESSES)
    assert all(abs(n - even) <= 0.1 * even for n in got), got
    if kind == "link":
        assert summary["stats"]["local"] == 0 and summary["stats"]["outages"] == 0


def test_a_replica_killed_fails_no_call_and_gets_work_again_once_ready(replicas):
    """The vLLM link (no retries: failovers only); the first address killed, which the link's
    /health probe (`healthy`) passes over for the others."""
    client = driver(replicas, ADDRESSES, "--client", "link")
    killed = 0
    try:
        client.ask("start", threads=2)
        time.sleep(1.0)
        replicas.kill(killed)
        time.sleep(1.5)
        assert client.ask("healthy")["healthy"]
        replicas.launch(killed)  # listening soon; /health/ready 503 until its workers are up

        def ready() -> bool:
            try:
                return httpx.get(replicas.url(killed) + "/health/ready", timeout=5).is_success
            except httpx.HTTPError:
                return False

        wait_for(ready, 120, "the restarted replica never said ready", 0.05)
        wait_for(
            lambda: replicas.counts(killed).get(200, 0) > 0,
            10,
            "the restarted replica got no work once ready",
        )
        summary = client.ask("stop")
    finally:
        client.close()
        replicas.wait(killed)
    no_failures(summary)
    assert summary["stats"]["local"] == 0 and summary["stats"]["outages"] == 0
    # work sent while it started would have been answered 503 (and counted)
    assert replicas.counts(killed).get(503, 0) == 0


def test_the_client_follows_the_hosts_file_within_its_resolve_period(replicas):
    every = 1.0
    first, later = ADDRESSES[:2], ADDRESSES[1:]
    client = driver(replicas, first, "--resolve-every", str(every))
    hosts: Path = replicas.tmp / "hosts"
    try:
        assert {e["address"] for e in client.hello["endpoints"]} == set(first)
        client.ask("start", threads=2)
        before = replicas.answered()
        time.sleep(0.5)
        assert answered_since(replicas, before)[2] == 0
        hosts.write_text(hosts_text(later))  # truncated and written: the mounted file itself
        changed = time.monotonic()
        wait_for(lambda: answered_since(replicas, before)[2] > 0, every + 5, "3rd not taken up")
        taken_up = time.monotonic() - changed
        settled = replicas.answered()
        time.sleep(every)
        dropped = answered_since(replicas, settled)
        endpoints = client.ask("endpoints")["endpoints"]
        summary = client.ask("stop")
    finally:
        client.close()
    no_failures(summary)
    assert taken_up <= every + 1.0
    assert dropped[0] == 0 and dropped[1] > 0 and dropped[2] > 0, dropped
    assert {e["address"] for e in endpoints} == set(later)
