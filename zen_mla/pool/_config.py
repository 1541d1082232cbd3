"""The pool's settings, one object built once and handed to every part of the pool."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .topology import SYSFS

__all__ = ["PoolConfig"]


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """workers: None for one per CCX; smt: also use SMT siblings; times in seconds.

    Workers send a heartbeat every `ping_interval`; one silent for `ping_timeout` is "stuck":
    reported not alive while busy (its work is left to finish or be abandoned), replaced while
    idle.
    """

    workers: int | None = None
    smt: bool = False
    ping_interval: float = 1.0
    ping_timeout: float = 10.0
    start_timeout: float = 180.0
    cache_bytes: int = 1 << 30
    sysfs: Path = SYSFS
