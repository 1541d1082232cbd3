"""Real `zen-mla serve` processes (tests/service/servers.py), one per configuration, shared by
the package. Every test here starts a server or a process, or fuzzes the app through its engine:
all are marked slow, but for the modules in IN_PROCESS, which run the app's parts in this
process and start nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.servers import Server, serve

HERE = Path(__file__).resolve().parent
IN_PROCESS = {"test_egress.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE) and item.path.name not in IN_PROCESS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default configuration, two workers where there are two CPUs, small limits."""
    with serve(
        tmp_path_factory.mktemp("server"),
        workers=min(2, len(os.sched_getaffinity(0))),
        max_body_bytes=64 << 20,
        max_work=1 << 36,
    ) as s:
        yield s


@pytest.fixture(scope="package")
def uds_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("uds"), uds=True, workers=1) as s:
        yield s
