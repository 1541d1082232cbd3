"""Worker processes pinned to CCXs, with tensors crossing through shared memory."""

from ._shm import SharedBuffer
from ._supervisor import PoolConfig, PoolJob, PoolResult, WorkerPool

__all__ = ["PoolConfig", "PoolJob", "PoolResult", "SharedBuffer", "WorkerPool"]
