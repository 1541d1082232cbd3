"""When the twins send an exchange again: a request the server never read (`Resend`), told
by whether any byte of an answer came (`Heard`, marked by the clients' sockets)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import h11
import httpx

from ._deadline import Deadline

__all__ = ["AnswerBrokenOff", "Heard", "Resend", "heard"]

# Failures of a send where the server closed the connection before any answer: a close (EOF:
# httpcore's "Server disconnected without sending a response"), or a reset met while reading or
# writing.
_CLOSED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# Failures before a byte of the request went out, through any transport.
_UNSENT = (httpx.ConnectError, httpx.UnsupportedProtocol)


class Heard:
    """What one send's connection carried, as the clients' sockets (`_transport`) saw it:
    `sent`, bytes of the request went out; `answer`, bytes came back. Both stay False through
    a transport of the caller's own, whose sockets are not the clients'."""

    __slots__ = ("answer", "sent")

    def __init__(self) -> None:
        self.sent = False
        self.answer = False


# The send under way in this thread or task (`Resend.send` sets it for the send's length): what
# its connection carries is marked there.
_SEND: contextvars.ContextVar[Heard | None] = contextvars.ContextVar("zen_mla_send", default=None)


def heard(*, sent: bytes | None = None, came: bytes | None = None) -> None:
    """Marks the send under way: bytes of it went out (`sent`), or bytes came back (`came`);
    called by the clients' sockets on each write and read."""
    send = _SEND.get()
    if send is not None:
        if sent:
            send.sent = True
        if came:
            send.answer = True


class AnswerBrokenOff(httpx.TransportError):
    """A transport failure once bytes of an answer came (or where the client cannot tell that
    none did): the server read the request, and may have done the work. It is never sent again,
    to this endpoint or to another."""


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
    status, a malformed answer, or a failure once any byte of an answer came (a part of its
    head, too), is never sent again, here or to another endpoint (`AnswerBrokenOff`): the
    server read the request, and may have done the work. Through a transport of the caller's
    own the client cannot see the bytes that came: a failure there is taken for one after an
    answer began, unless the connection was never made. A close before any answer could,
    rarely, be a server that read the request and died; a prefill is a pure function of its
    request (the service keeps nothing of it), so a second send costs at most the work again.

    `idempotent` (a GET): a failure after an answer began is raised as it came, and another
    endpoint may be asked."""

    def __init__(self, deadline: Deadline, *, idempotent: bool = False) -> None:
        self._deadline = deadline
        self._idempotent = idempotent
        self._sends = 0
        self._answered = False  # the current send's answer has begun

    @contextlib.contextmanager
    def send(self) -> Iterator[None]:
        """One send; a failure of it that earns another send ends the block, others are raised
        (`AnswerBrokenOff` where the server may have read the request)."""
        self._sends += 1
        self._answered = False
        carried = Heard()
        token = _SEND.set(carried)
        try:
            yield
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.TimeoutException):
                raise  # never sent again: what ran out is the call's time
            began = self._answered or carried.answer
            # through a transport of the caller's own nothing is marked: only a connection
            # never made is known to have carried nothing
            unseen = not carried.sent and not isinstance(exc, _UNSENT)
            if (began or unseen) and not self._idempotent:
                raise AnswerBrokenOff(
                    f"the connection failed once the service may have read the request: {exc}"
                ) from exc
            if began or not _closed_unanswered(exc) or not self._may():
                raise
        finally:
            _SEND.reset(token)

    def answered(self) -> None:
        """The answer's head came: whatever fails from now on, the server read the request."""
        self._answered = True

    def again(self, status: int) -> bool:
        """Whether the request is sent again after an answer of `status`."""
        return status == 408 and self._may()

    def _may(self) -> bool:
        left = self._deadline.remaining()
        return self._sends < 2 and (left is None or left > 0)
