"""PoolConfig: the heartbeat's settings under their names, and their earlier names still taken
(with a warning) by callers that built a pool with them."""

from __future__ import annotations

import pytest

from zen_mla.pool import PoolConfig


def test_heartbeat_settings_have_their_names():
    config = PoolConfig(heartbeat_interval=0.5, heartbeat_timeout=4.0)
    assert (config.heartbeat_interval, config.heartbeat_timeout) == (0.5, 4.0)


def test_the_earlier_names_warn_and_set_the_heartbeat():
    with pytest.warns(DeprecationWarning, match="is deprecated: use heartbeat_") as warned:
        config = PoolConfig(workers=1, ping_interval=0.25, ping_timeout=3.0)
    assert (config.heartbeat_interval, config.heartbeat_timeout) == (0.25, 3.0)
    assert config.workers == 1
    assert [str(w.message).split("=")[0] for w in warned] == [
        "PoolConfig(ping_interval",
        "PoolConfig(ping_timeout",
    ]
    assert warned[0].filename == __file__  # the caller's line, not the dataclass's
