"""Real `zen-mla serve` processes (tests/service/servers.py), one per configuration, shared by
the package."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.service.servers import Server, serve


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
