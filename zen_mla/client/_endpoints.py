"""The endpoints of a client and what a failed attempt on one means: which is least loaded and
which is passed over (`Balancer`), the one translation of transport errors into zen_mla's
(`Translated`), and whether, where and when a call is tried again (`next_step`)."""

from __future__ import annotations

import itertools
import threading
import time
from types import TracebackType

import httpx

from ..errors import (
    DeadlineExceededError,
    OverloadedError,
    ServiceUnavailableError,
    ZenMLAError,
)
from ._deadline import Deadline
from ._resend import AnswerBrokenOff

__all__ = ["DOWN_FOR", "MAX_RETRY_WAIT", "Balancer", "Translated", "next_step"]

MAX_RETRY_WAIT = 30.0
DOWN_FOR = 5.0  # seconds an unreachable endpoint is passed over


class Balancer:
    """Outstanding work per endpoint; `pick` gives the least loaded one not passed over."""

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


def _transport_error(exc: httpx.TransportError, deadline: Deadline, i: int) -> ZenMLAError:
    """The one place transport errors become zen_mla exceptions."""
    if isinstance(exc, httpx.TimeoutException):
        left = deadline.remaining()
        if left is not None and left <= 0:
            return deadline.exceeded()
        return DeadlineExceededError(f"no answer in time from endpoint {i}: {exc}")
    if isinstance(exc, AnswerBrokenOff):
        return ServiceUnavailableError(f"endpoint {i} broke off its answer: {exc}")
    return ServiceUnavailableError(f"endpoint {i} unreachable: {exc}")


class Translated:
    """Within the block, a transport error with endpoint `i` is raised as its zen_mla exception."""

    def __init__(self, deadline: Deadline, i: int) -> None:
        self._deadline, self._i = deadline, i

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, httpx.TransportError):
            raise _transport_error(exc, self._deadline, self._i) from exc


def _retry_wait(exc: OverloadedError, attempt: int) -> float:
    return min(exc.retry_after if exc.retry_after is not None else 0.5 * 2**attempt, MAX_RETRY_WAIT)


def next_step(
    exc: Exception,
    i: int,
    tried: set[int],
    n: int,
    attempt: int,
    retries: int,
    bal: Balancer,
    deadline: Deadline,
) -> float:
    """After a failed attempt on endpoint i: seconds to wait before the next one, or raise. A
    wait that would end past the call's deadline is not waited: the error is raised now. A
    request endpoint i may have read (`AnswerBrokenOff`) goes to no other."""
    tried.add(i)
    if isinstance(exc, httpx.TransportError):
        error = _transport_error(exc, deadline, i)
        if isinstance(error, DeadlineExceededError):
            raise error from exc
        bal.down(i)
        if isinstance(exc, AnswerBrokenOff) or attempt >= retries or len(tried) >= n:
            raise error from exc
        return 0.0
    if not isinstance(exc, OverloadedError) or attempt >= retries:
        raise exc
    if len(tried) < n:
        return 0.0  # another endpoint may have room now
    tried.clear()
    wait = _retry_wait(exc, attempt)
    left = deadline.remaining()
    if left is not None and wait >= left:
        exc.add_note(f"not retried: the wait of {wait:g} s ends past the call's timeout")
        raise exc
    return wait
