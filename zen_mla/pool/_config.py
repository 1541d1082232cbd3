"""The pool's settings, one object built once and handed to every part of the pool."""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass
from pathlib import Path

from .topology import SYSFS

__all__ = ["PoolConfig"]


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """workers: None for one per CCX; smt: also use SMT siblings; times in seconds.

    Workers send a heartbeat every `heartbeat_interval`; one silent for `heartbeat_timeout` is
    "stuck": reported not alive while busy (its work is left to finish or be abandoned),
    replaced while idle.

    `min_piece_cost` (heads x visible query-key pairs): work is split over workers only into
    pieces of at least this much. Below it a second kernel call and a second worker's hop cost
    more than the compute they share (a kernel call costs about 0.07 ms before any work, and
    2^17 head-pairs of MLA work take about 0.7 ms on one Zen 5 core), so a small call runs
    whole on one worker. With one worker nothing is split.

    `min_thread_cost`: a task of less work runs on one of its worker's threads. Waking the
    others costs more than they share below it, and they spin afterwards on cores the caller
    may need (region calls paired on 2 vCPUs shared with the caller, Zen 5: 1 and 16 tokens of
    16 heads 12-22 % faster on one thread, 64 tokens (2^15 head-pairs) 0.87-1.02x across runs,
    128 tokens (2^17) 21 % slower).
    """

    workers: int | None = None
    smt: bool = False
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    start_timeout: float = 180.0
    cache_bytes: int = 1 << 30
    min_piece_cost: int = 1 << 17
    min_thread_cost: int = 1 << 16
    sysfs: Path = SYSFS
    # deprecated names of heartbeat_interval and heartbeat_timeout (keywords only; removed in 0.3)
    ping_interval: InitVar[float | None] = None
    ping_timeout: InitVar[float | None] = None

    def __post_init__(self, ping_interval: float | None, ping_timeout: float | None) -> None:
        for old, new, value in (
            ("ping_interval", "heartbeat_interval", ping_interval),
            ("ping_timeout", "heartbeat_timeout", ping_timeout),
        ):
            if value is not None:
                message = f"PoolConfig({old}=) is deprecated: use {new}="
                warnings.warn(message, DeprecationWarning, stacklevel=3)
                object.__setattr__(self, new, value)
