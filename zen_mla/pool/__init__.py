"""Worker processes pinned to CCXs, with tensors crossing through shared memory.

Importing the package does not import torch: a worker process imports it (its entry point is
`_worker.main`) before it has set its CPU affinity and thread environment. The names below load
on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
    from ._config import PoolConfig
    from ._job import OutputPlaces, PoolJob, PoolResult, Reply
    from ._shm import SharedBuffer
    from ._supervisor import WorkerPool

__all__ = [
    "OutputPlaces",
    "PoolConfig",
    "PoolJob",
    "PoolResult",
    "Reply",
    "SharedBuffer",
    "WorkerPool",
]

_LAZY = {
    "OutputPlaces": "._job",
    "PoolConfig": "._config",
    "PoolJob": "._job",
    "PoolResult": "._job",
    "Reply": "._job",
    "SharedBuffer": "._shm",
    "WorkerPool": "._supervisor",
}

__getattr__ = lazy_names(__name__, _LAZY)
