"""When the twins send an exchange again: a request the server never read (`Resend`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import h11
import httpx

from ._deadline import Deadline

__all__ = ["Resend"]

# Failures of a send where the server closed the connection before any answer: a close (EOF:
# httpcore's "Server disconnected without sending a response"), or a reset met while reading or
# writing.
_CLOSED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def _closed_unanswered(exc: httpx.TransportError) -> bool:
    """Whether `exc`, raised before an answer's head came, is the server closing the connection,
    not an answer that came malformed (h11's parse error, behind httpcore's and httpx's: bytes
    of an answer mean the server read the request)."""
    if not isinstance(exc, _CLOSED):
        return False
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, h11.RemoteProtocolError):
            return False
        seen.add(id(cause))
        # httpcore raises its error while handling h11's (its context, not its cause)
        cause = cause.__cause__ or cause.__context__
    return True


class Resend:
    """One exchange's sends: the request goes again, once, where the server never read it, while
    the call's deadline leaves time; an answer, or a failure, of the second send is the
    exchange's (raised or decoded as without a resend: a RequestTimeoutError for the 408, a
    ServiceUnavailableError for the close).

    Never read, that is never taken up, as the server says or shows before any answer:
    - a 408 (RFC 9110 15.5.9: it did not receive a complete request). The service answers one to
      an idle keep-alive connection it closes to make room at its connection cap (the close may
      cross a request going out: the 408 then answers it), to headers that did not come in time,
      and to a body too slow or cut off for a faster one; in none did any work start;
    - the connection closed or reset before any byte of an answer: a kept connection the server
      closed just as the request went out.
    The second send goes on another connection: httpcore closes the first one, and drops a
    pooled one the server closed before handing it out.

    A POST is not idempotent in general; one the server never read is safe to send again (RFC
    9112 9.3.1: the client can tell that the request was never applied). An answer of any other
    status, a malformed answer, or a failure after an answer's head came, is never sent again:
    the server read the request, and may have done the work. A close before any answer could,
    rarely, be a server that read the request and died; a prefill is a pure function of its
    request (the service keeps nothing of it), so a second send costs at most the work again."""

    def __init__(self, deadline: Deadline) -> None:
        self._deadline = deadline
        self._sends = 0
        self._answered = False  # the current send's answer has begun

    @contextlib.contextmanager
    def send(self) -> Iterator[None]:
        """One send; a failure of it that earns another send ends the block, others are raised."""
        self._sends += 1
        self._answered = False
        try:
            yield
        except httpx.TransportError as exc:
            if self._answered or not _closed_unanswered(exc) or not self._may():
                raise

    def answered(self) -> None:
        """The answer's head came: whatever fails from now on, the server read the request."""
        self._answered = True

    def again(self, status: int) -> bool:
        """Whether the request is sent again after an answer of `status`."""
        return status == 408 and self._may()

    def _may(self) -> bool:
        left = self._deadline.remaining()
        return self._sends < 2 and (left is None or left > 0)
