"""Real `zen-mla serve` processes (tests/service/servers.py), one per configuration, shared by
the package. A test is slow by what it uses, not by where it lives: one that takes a server
from a fixture made with `server_fixture` is marked slow here; one that starts a server or a
process itself carries the marker; any other runs in the fast tier."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service import servers
from tests.service.servers import SERVER_FIXTURES, Server, serve, server_fixture

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        uses = SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if uses and item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # before any fixture of the test is set up, a package-scoped server included
    servers.running_slow = item.get_closest_marker("slow") is not None


def pytest_runtest_teardown(item: pytest.Item) -> None:
    servers.running_slow = True


@server_fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default configuration, two workers where there are two CPUs, small limits."""
    with serve(
        tmp_path_factory.mktemp("server"),
        workers=min(2, len(os.sched_getaffinity(0))),
        max_body_bytes=64 << 20,
        max_work=1 << 36,
    ) as s:
        yield s


@server_fixture(scope="package")
def uds_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("uds"), uds=True, workers=1) as s:
        yield s
