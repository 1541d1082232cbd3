from __future__ import annotations

import pytest

import zen_mla

#: fixtures that start worker processes: a test that uses one is slow (tests/service/conftest.py
#: marks the tests that start servers)
STARTS_WORKERS = {"pool", "engine"}


def _zentorch_reason() -> str:
    status = zen_mla.zentorch_status()
    return "" if status["ops"]["zentorch_sdpa"] else f"zentorch unusable: {status['reason']}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if STARTS_WORKERS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    reason = _zentorch_reason()
    if not reason:
        return
    for item in items:
        if item.get_closest_marker("zentorch") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
