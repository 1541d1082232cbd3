"""What a failed attempt on an endpoint leads to: the zen_mla error it is (the one translation of
transport errors, also for exchanges never retried: `Translated`), and whether, where and when
the call is tried again (`next_step`)."""

from __future__ import annotations

from types import TracebackType

import httpx

from ..errors import (
    DeadlineExceededError,
    OverloadedError,
    ServiceUnavailableError,
    ZenMLAError,
)
from ._deadline import Deadline
from ._endpoints import Balancer
from ._resend import AnswerBrokenOff

__all__ = ["MAX_RETRY_WAIT", "Translated", "next_step"]

MAX_RETRY_WAIT = 30.0


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
    attempt: int,
    retries: int,
    bal: Balancer,
    deadline: Deadline,
) -> float:
    """After a failed attempt on endpoint i: seconds to wait before the next one, or raise. A
    wait that would end past the call's deadline is not waited: the error is raised now. A
    request endpoint i may have read (`AnswerBrokenOff`) goes to no other; an unreachable
    endpoint is passed over a while (`Balancer.down`)."""
    tried.add(i)
    n = len(bal)
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
