"""One call's deadline: a whole call (connect, send, wait, read, retries and their waits) ends
by it, whichever way its bytes go."""

from __future__ import annotations

import time

import httpx

from ..errors import DeadlineExceededError

__all__ = ["CONNECT_SHARE", "Deadline", "call_budget"]

#: of what a call has left, the most one connect (TCP, and TLS's handshake) may take while the
#: call has another endpoint to go to: one whose connects hang leaves the call time to go on
CONNECT_SHARE = 0.25


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
        # of what is left, the most a connect may take now (`connect_timeout`): all of it,
        # or CONNECT_SHARE while the call has another endpoint (set by each attempt)
        self.connect_share = 1.0

    def remaining(self) -> float | None:
        """Seconds left, <= 0 once past; None without a bound."""
        return None if self._at is None else self._at - time.monotonic()

    def connect_timeout(self, timeout: float | None) -> float | None:
        """Seconds a connect may take now: `timeout` (the client's connect phase, None for no
        bound), cut to `connect_share` of what is left (<= 0 once past)."""
        left = self.remaining()
        if left is None:
            return timeout
        share = left if left <= 0 else left * self.connect_share
        return share if timeout is None else min(timeout, share)

    def check(self) -> None:
        left = self.remaining()
        if left is not None and left <= 0:
            raise self.exceeded()

    def exceeded(self) -> DeadlineExceededError:
        return DeadlineExceededError(f"no answer within the call's timeout of {self.budget:g} s")
