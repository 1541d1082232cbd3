"""`Deadline`: when a call must end, one type from the client to the worker.

The client makes one from its timeout and sends what is left of it with each attempt, where
the protocol has a place for it: the `Zen-MLA-Timeout` header on HTTP (`/prefill`, `/v2`), a
region call's `timeout` field, KServe v2's `timeout` parameter (microseconds), gRPC's own
deadline. The service makes one from what it was sent, counted from the request's arrival, and
drops work still queued when it passes (work a worker has begun runs on: stopping a worker costs
a restart, which no caller may cause at will); its own `--deadline-s` bounds everything else.
Both read the monotonic clock, the event loop's too.
"""

from __future__ import annotations

import math
import time

from .errors import DeadlineExceededError, InvalidInputError

__all__ = ["HEADER", "Deadline", "seconds_text", "timeout_of"]

#: the HTTP header a caller's remaining seconds travel in
HEADER = "Zen-MLA-Timeout"


class Deadline:
    """When one call (connect, send, wait, read, and the retries with their waits) must end:
    `budget` seconds after `start` (the monotonic clock; now by default), None for no bound."""

    def __init__(self, budget: float | None, start: float | None = None) -> None:
        self.budget = budget
        self.start = time.monotonic() if start is None else start
        self.at = None if budget is None else self.start + budget
        # of what is left, the most a connect may take now (`connect_timeout`): all of it,
        # or a share while the call has another endpoint (set by each attempt)
        self.connect_share = 1.0

    def remaining(self) -> float | None:
        """Seconds left, <= 0 once past; None without a bound."""
        return None if self.at is None else self.at - time.monotonic()

    def connect_timeout(self, timeout: float | None) -> float | None:
        """Seconds a connect may take now: `timeout` (the client's connect phase, None for no
        bound), cut to `connect_share` of what is left (<= 0 once past)."""
        left = self.remaining()
        if left is None:
            return timeout
        share = left if left <= 0 else left * self.connect_share
        return share if timeout is None else min(timeout, share)

    def passed(self) -> bool:
        """Whether it is past (never without a bound)."""
        left = self.remaining()
        return left is not None and left <= 0

    def check(self) -> None:
        if self.passed():
            raise self.exceeded()

    def exceeded(self) -> DeadlineExceededError:
        return DeadlineExceededError(f"no answer within the call's timeout of {self.budget:g} s")


def timeout_of(value: object, what: str, unit: float = 1.0) -> float:
    """A caller's timeout in seconds: `value` (a number, or its text: a header's, a field's) in
    units of `unit` seconds (1e-6 for KServe v2's microseconds), finite and > 0, else
    InvalidInputError naming `what`."""
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and len(value) <= 32:
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or number <= 0:
        unit_name = "seconds" if unit == 1.0 else "microseconds"
        raise InvalidInputError(what, f"{unit_name}, a finite number > 0", repr(value)[:40])
    return number * unit


def seconds_text(seconds: float) -> str:
    """What a client sends of the `seconds` it has left (at least a millisecond)."""
    return f"{max(seconds, 0.001):.3f}"
