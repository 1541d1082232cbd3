"""One call's deadline: a whole call (connect, send, wait, read, retries and their waits) ends
by it, whichever way its bytes go."""

from __future__ import annotations

import time

import httpx

from ..errors import DeadlineExceededError

__all__ = ["Deadline", "call_budget"]


def call_budget(timeout: httpx.Timeout | float) -> float | None:
    """A whole call's seconds: a number as it is; an httpx.Timeout's longest phase (None, no
    bound, when a phase has none)."""
    if isinstance(timeout, httpx.Timeout):
        phases = (timeout.connect, timeout.read, timeout.write, timeout.pool)
        return None if any(p is None for p in phases) else max(p for p in phases if p is not None)
    return float(timeout)


class Deadline:
    """When one call (connect, send, wait, read, and the retries with their waits) must end."""

    def __init__(self, budget: float | None) -> None:
        self.budget = budget
        self._at = None if budget is None else time.monotonic() + budget

    def remaining(self) -> float | None:
        """Seconds left, <= 0 once past; None without a bound."""
        return None if self._at is None else self._at - time.monotonic()

    def check(self) -> None:
        left = self.remaining()
        if left is not None and left <= 0:
            raise self.exceeded()

    def exceeded(self) -> DeadlineExceededError:
        return DeadlineExceededError(f"no answer within the call's timeout of {self.budget:g} s")
