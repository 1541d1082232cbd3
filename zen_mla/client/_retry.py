"""What a failed attempt on an endpoint leads to: the zen_mla error it is (the one translation of
transport errors, also for exchanges never retried: `Translated`), and whether, where and when
the call is tried again (`failover`, `next_step`)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import httpx

from ..errors import (
    DeadlineExceededError,
    OverloadedError,
    ServiceUnavailableError,
    ZenMLAError,
)
from ._deadline import Deadline
from ._endpoints import Balancer, Endpoint
from ._resend import AnswerBrokenOff

__all__ = ["MAX_RETRY_WAIT", "Translated", "failover", "next_step"]

MAX_RETRY_WAIT = 30.0


def _transport_error(
    exc: httpx.TransportError, deadline: Deadline, ep: Endpoint[Any]
) -> ZenMLAError:
    """The one place transport errors become zen_mla exceptions. A connect that timed out
    while the call has time left is an endpoint unreachable, as a refused one is."""
    if isinstance(exc, httpx.TimeoutException):
        left = deadline.remaining()
        if left is not None and left <= 0:
            return deadline.exceeded()
        if not isinstance(exc, httpx.ConnectTimeout):
            return DeadlineExceededError(f"no answer in time from endpoint {ep.name}: {exc}")
    if isinstance(exc, AnswerBrokenOff):
        return ServiceUnavailableError(f"endpoint {ep.name} broke off its answer: {exc}")
    return ServiceUnavailableError(f"endpoint {ep.name} unreachable: {exc}")


class Translated:
    """Within the block, a transport error with endpoint `ep` is raised as its zen_mla
    exception."""

    def __init__(self, deadline: Deadline, ep: Endpoint[Any]) -> None:
        self._deadline, self._ep = deadline, ep

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, httpx.TransportError):
            raise _transport_error(exc, self._deadline, self._ep) from exc


def _retry_wait(exc: OverloadedError, attempt: int) -> float:
    return min(exc.retry_after if exc.retry_after is not None else 0.5 * 2**attempt, MAX_RETRY_WAIT)


def _unserved(exc: Exception, deadline: Deadline) -> bool:
    """Whether `exc` says the endpoint took no part of the request: no connection was made
    (refused, or its connect timed out with the call's time left), or the service answered
    503 (starting, draining, no worker alive: it did no work) or closed its region socket (a
    prefill is a pure function of its request: sent again, it costs at most the work again)."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        left = deadline.remaining()
        return left is None or left > 0
    return isinstance(exc, ServiceUnavailableError)


def failover(
    exc: Exception, ep: Endpoint[Any], tried: set[Endpoint[Any]], bal: Balancer[Any],
    deadline: Deadline,
) -> bool:  # fmt: skip
    """After a failed attempt on `ep`: whether the call goes on at once, as no retry, to another
    address of the same name not yet tried (as a connect to a name tries its addresses in
    turn). Only where `ep` took no part of the request (`_unserved`): it is left out then
    until it answers its readiness probe (`Balancer.down`)."""
    if not _unserved(exc, deadline):
        return False
    bal.down(ep)
    if not bal.untried_sibling(ep, tried):
        return False
    tried.add(ep)
    return True


def next_step(
    exc: Exception,
    ep: Endpoint[Any],
    tried: set[Endpoint[Any]],
    attempt: int,
    retries: int,
    bal: Balancer[Any],
    deadline: Deadline,
) -> float:
    """After a failed attempt on endpoint `ep`: seconds to wait before the next one, or raise. A
    wait that would end past the call's deadline is not waited: the error is raised now. A
    request `ep` may have read (`AnswerBrokenOff`), or that timed out there, goes to no other;
    an endpoint whose connection failed or timed out (a connect, a read), or that answered
    503, is left out until it answers its readiness probe (`Balancer.down`), also where the
    call ends with the error."""
    tried.add(ep)
    n = len(bal)
    if isinstance(exc, httpx.TransportError):
        bal.down(ep)
        error = _transport_error(exc, deadline, ep)
        last = isinstance(error, DeadlineExceededError) or isinstance(exc, AnswerBrokenOff)
        if last or attempt >= retries or len(tried) >= n:
            raise error from exc
        return 0.0
    if isinstance(exc, ServiceUnavailableError):
        bal.down(ep)
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
