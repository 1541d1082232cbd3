"""A client's endpoints and which one a call goes to: the least loaded by outstanding work (a
request's weight: `weigh`), passing over one found unreachable a while (`Balancer`)."""

from __future__ import annotations

import itertools
import threading
import time

import torch

from ..attention.batch import total_visible_pairs

__all__ = ["DOWN_FOR", "Balancer", "weigh"]

DOWN_FOR = 5.0  # seconds an unreachable endpoint is passed over


def weigh(q: torch.Tensor, q_cu: torch.Tensor, kv_cu: torch.Tensor | None, causal: bool) -> int:
    """A request's weight for balancing: heads x visible (query, key) pairs (of tensors as
    `_inputs.checked_tensors` checked them: q 3-D, cu_seq_lens 1-D integers)."""
    qc = q_cu.tolist()
    kc = kv_cu.tolist() if kv_cu is not None else qc
    return int(q.shape[1]) * total_visible_pairs(qc, kc, causal)


class Balancer:
    """Outstanding work per endpoint; `pick` gives the least loaded one not passed over. Its
    lock guards `outstanding` and `down_until` (calls in several threads share a client)."""

    def __init__(self, n: int) -> None:
        self.outstanding = [0] * n
        self.down_until = [0.0] * n
        self._lock = threading.Lock()
        self._turn = itertools.count()

    def pick(self, tried: set[int]) -> int:
        now = time.monotonic()
        with self._lock:
            n = len(self.outstanding)
            candidates = [i for i in range(n) if i not in tried] or list(range(n))
            up = [i for i in candidates if self.down_until[i] <= now] or candidates
            turn = next(self._turn)
            return min(up, key=lambda i: (self.outstanding[i], (i - turn) % n))

    def begin(self, i: int, work: int) -> None:
        with self._lock:
            self.outstanding[i] += work

    def end(self, i: int, work: int) -> None:
        with self._lock:
            self.outstanding[i] -= work

    def down(self, i: int) -> None:
        with self._lock:
            self.down_until[i] = time.monotonic() + DOWN_FOR

    def __len__(self) -> int:
        """How many endpoints."""
        return len(self.outstanding)
