from __future__ import annotations

import pytest

import zen_mla


def _zentorch_reason() -> str:
    status = zen_mla.zentorch_status()
    return "" if status["ops"]["zentorch_sdpa"] else f"zentorch unusable: {status['reason']}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = _zentorch_reason()
    if not reason:
        return
    for item in items:
        if item.get_closest_marker("zentorch") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
