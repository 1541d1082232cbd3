"""One call's deadline (`zen_mla.deadline.Deadline`): a whole call (connect, send, wait, read,
retries and their waits) ends by it, whichever way its bytes go; what a connect may take of it."""

from __future__ import annotations

import httpx

from ..deadline import Deadline

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
