"""Replicas behind one name that fail without refusing (tests/client/replicas.py: the client in
a process whose /etc/hosts, a private mount namespace's, names them; the real resolver's path).
Beside a real `zen-mla serve` at 127.0.0.1: an address that takes connections and answers
nothing (`SilentServer`) and one whose connects hang (`FullBacklog`); and a name whose other
addresses, hundreds, have no one listening. After at most one failed call every call goes to
the good replica, answered right and fast; the silent one is probed, not used, until its
`/health/ready` says 200; dead addresses by the hundred cost later calls and the idle client
next to nothing. Slow: it starts a server."""

from __future__ import annotations

import concurrent.futures
import socket
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.client.clients import CLIENTS
from tests.client.fake_server import FullBacklog, SilentServer
from tests.client.replicas import NAME, Driver, Replicas, hosts_text, namespace_problem
from tests.processes import wait_for
from tests.service.servers import check_slow

pytestmark = pytest.mark.slow

TIMEOUT = 2.0  # the client's, seconds: a whole call's deadline
GOOD, SILENT, HUNG = "127.0.0.1", "127.0.0.2", "127.0.0.3"
# loopback addresses no one listens on (a connect there is refused at once)
DEAD = [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(999)]


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    """One `zen-mla serve` at 127.0.0.1 (Replicas' first address)."""
    tmp = tmp_path_factory.mktemp("stalled")
    problem = namespace_problem(tmp)
    if problem:
        pytest.skip(f"no /etc/hosts of the client's own: {problem}")
    check_slow()
    replicas = Replicas(tmp)
    try:
        replicas.launch(0)
        replicas.wait(0)
        yield replicas
    finally:
        replicas.close()


def driver(good: Replicas, hosts: str, addresses: list[str], *options: str) -> Driver:
    path = good.tmp / hosts
    path.write_text(hosts_text(addresses))
    url = f"http://{NAME}:{good.port}"
    return Driver(path, url, "--timeout", str(TIMEOUT), *options)


def connect_hangs(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.3).close()
    except TimeoutError:
        return True
    return False


def down(client: Driver) -> dict[str, bool]:
    return {e["address"]: e["down"] for e in client.ask("endpoints")["endpoints"]}


def failed(records: list[Any]) -> list[Any]:
    return [r for r in records if r[2] != "ok"]


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_silent_and_a_hung_address_cost_one_call_at_most(good, kind):
    with SilentServer(SILENT, good.port) as silent, FullBacklog(HUNG, good.port):
        assert connect_hangs(HUNG, good.port)
        client = driver(good, f"hosts-{kind}", [GOOD, SILENT, HUNG], "--client", kind)
        try:
            before = good.counts(0).get(200, 0)
            first = client.ask("run", calls=12)
            records = [client.hello["first"], *first["records"]]
            assert len(failed(records)) <= 1, failed(records)
            assert all(r[1] < 0.1 * TIMEOUT for r in records[-8:]), records  # past both
            served = len(first["records"]) - len(failed(first["records"]))
            assert good.counts(0).get(200, 0) - before == served  # all at the good replica
            # the calls go on: the bad addresses are probed (the silent one's /health/ready
            # holds a probe each time), and take no work
            later = client.ask("run", calls=150)
            states = down(client)
            assert states == {GOOD: False, SILENT: True, HUNG: True}
            came = [path for what, path in silent.seen() if what == "came"]
            assert came.count("/prefill") <= 1 and "/health/ready" in came, came
            assert later["ok"] == 150 and later["max"] < 0.1 * TIMEOUT, later["errors"]

            # ready again: it gets work, and only after a probe's 200
            silent.wake()
            seen = len(silent.seen())
            client.ask("start")
            wait_for(
                lambda: ("came", "/prefill") in silent.seen()[seen:],
                3 * TIMEOUT,
                "the silent address got no work once ready",
                0.05,
            )
            woken = client.ask("stop")
        finally:
            client.close()
    events = silent.seen()
    work = events.index(("came", "/prefill"), seen)
    assert ("answered", "/health/ready") in events[:work], events
    assert woken["errors"] == {} and woken["past_deadline"] == 0


def test_hundreds_of_dead_addresses_cost_later_calls_and_the_idle_client_nothing(good):
    """999 addresses refusing connects, the replica among them, against the name for the
    replica alone (both clients at once, their calls in turns): later calls' median, the
    client's CPU per call, and idle."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(driver, good, "hosts-alone", [GOOD]),
            pool.submit(driver, good, "hosts-many", [*DEAD[:500], GOOD, *DEAD[500:]]),
        ]
    drivers = [f.result() for f in starting if f.exception() is None]
    try:
        assert len(drivers) == 2, [f.exception() for f in starting]
        warm = [d.ask("run", calls=5) for d in drivers]  # the dead addresses found out
        rounds: list[list[dict[str, Any]]] = [[], []]
        for _ in range(3):
            for d, done in zip(drivers, rounds, strict=True):
                done.append(d.ask("run", calls=60))
        time.sleep(0.5)  # the probes under way end
        idle_from = drivers[1].ask("endpoints")
        time.sleep(2.0)
        idle_to = drivers[1].ask("endpoints")
    finally:
        for d in drivers:
            d.close()
    p50 = [statistics.median(r[1] for run in done for r in run["records"]) for done in rounds]
    cpu = [
        sum(run["cpu"] - before["cpu"] for run, before in zip(done, [w, *done], strict=False))
        for done, w in zip(rounds, warm, strict=True)
    ]
    idle = (idle_to["cpu"] - idle_from["cpu"]) / (idle_to["now"] - idle_from["now"])
    figures = {
        "first calls s": [drivers[1].hello["first"][1], *(r[1] for r in warm[1]["records"])],
        "p50 ms, alone and many": [t * 1e3 for t in p50],
        "cpu ms a call, alone and many": [c / 180 * 1e3 for c in cpu],
        "idle cpu": idle,
    }
    assert drivers[1].hello["first"][2] == "ok" and warm[1]["ok"] == 5
    assert all(run["ok"] == 60 for done in rounds for run in done)
    assert sum(e["down"] for e in idle_to["endpoints"]) == len(DEAD)
    assert p50[1] < 2 * p50[0] + 0.002, figures
    assert cpu[1] < 2 * cpu[0] + 0.1, figures  # probes and picks included
    assert idle < 0.02, figures  # of a core
