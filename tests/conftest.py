from __future__ import annotations

import pytest

from zen_mla.attention.probes import host_facts

#: fixtures that start worker processes: a test that uses one is slow (tests/service/conftest.py
#: marks the tests that start servers)
STARTS_WORKERS = {"pool", "engine"}


def _skip_reasons() -> dict[str, str | None]:
    """Marker -> why its tests skip on this host (None where they run)."""
    host = host_facts()
    return {
        "zentorch": host.zentorch_failure and f"zentorch unusable: {host.zentorch_failure}",
        "native": host.native_failure,
    }


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if STARTS_WORKERS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    for marker, reason in _skip_reasons().items():
        if not reason:
            continue
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
