"""The exceptions zen_mla raises, in one tree, and the one table of the codes each is answered
with (the tree draws its HTTP status; `ERROR_CODES` decides it).

    ZenMLAError
    ├── InvalidInputError (ValueError)      a tensor or argument breaks the contract     422
    │   ├── KernelUnavailableError          a kernel was forced where it cannot run      422
    │   ├── WorkTooLargeError               the request's work is over the cap           422
    │   └── WireFormatError                 the body is not a readable safetensors file  400
    ├── RequestRejectedError                the service refused the request as sent
    │   ├── UnauthorizedError               bad or missing bearer token                  401
    │   ├── ForbiddenError                  a feature this server has switched off       403
    │   ├── NotFoundError                   no such model, version or region             404
    │   ├── RequestTimeoutError (TimeoutError) headers or body slower than the limits 408
    │   ├── LengthRequiredError             no Content-Length                            411
    │   ├── BodyTooLargeError               Content-Length over the body limit           413
    │   ├── UnsupportedMediaTypeError       not application/octet-stream                 415
    │   └── HeadersTooLargeError            request line and headers over the cap        431
    ├── OverloadedError                     try again later (see `retry_after`)
    │   ├── QueueFullError                  the queue is full                            429
    │   └── ServiceUnavailableError         not ready, or draining                       503
    │       └── PoolClosedError             the worker pool is shut down                 503
    ├── DeadlineExceededError (TimeoutError) past the request deadline, work abandoned   504
    ├── KernelError (RuntimeError)          a kernel or worker failed on valid input     500
    ├── InternalError (RuntimeError)        a bug of the service, not of the request     500
    ├── SharedMemoryUnavailableError        client side: no same-host regions to be had     -
    └── ProtocolError                       client side: the answer broke the protocol      -

`ERROR_CODES` is the one table of what the service answers each class with: its HTTP status,
its gRPC status code, and whether a client that reads that HTTP status raises it. `STATUS` (class
to status), `BY_STATUS` (status to the class a client raises) and `ERROR_STATUSES` (every status
an error is answered with) are read from it, so an error arrives as the class it left as, on
every protocol. Across the pool's process boundary an error travels as its parts (`parts_of`,
`from_parts`), so a worker's InvalidInputError is one in the service too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BY_STATUS",
    "ERROR_CODES",
    "ERROR_STATUSES",
    "STATUS",
    "BodyTooLargeError",
    "DeadlineExceededError",
    "ErrorCodes",
    "ForbiddenError",
    "HeadersTooLargeError",
    "InternalError",
    "InvalidInputError",
    "KernelError",
    "KernelUnavailableError",
    "LengthRequiredError",
    "NotFoundError",
    "OverloadedError",
    "PoolClosedError",
    "ProtocolError",
    "QueueFullError",
    "RequestRejectedError",
    "RequestTimeoutError",
    "ServiceUnavailableError",
    "SharedMemoryUnavailableError",
    "UnauthorizedError",
    "UnsupportedMediaTypeError",
    "WireFormatError",
    "WorkTooLargeError",
    "ZenMLAError",
    "codes_of",
    "from_parts",
    "parts_of",
    "status_of",
]


class ZenMLAError(Exception):
    """Base class of every error zen_mla raises on purpose."""


class InvalidInputError(ZenMLAError, ValueError):
    """An input breaks the contract.

    `name` is the tensor or argument at fault, `expected` and `got` say what was wanted and what
    came; the message says all three, and how to fix it where that is not obvious.
    """

    def __init__(self, name: str, expected: str, got: str, hint: str = "") -> None:
        self.name = name
        self.expected = expected
        self.got = got
        self.hint = hint
        message = f"{name}: expected {expected}, got {got}"
        if hint:
            message = f"{message}. {hint}"
        super().__init__(message)


class KernelUnavailableError(InvalidInputError):
    """A kernel was asked for by name where it cannot run (not installed, or fails its probe)."""


class WorkTooLargeError(InvalidInputError):
    """The request's attention work is over the configured cap."""


class WireFormatError(InvalidInputError):
    """The request body is not a safetensors file this service can read."""


class RequestRejectedError(ZenMLAError):
    """The service refused the request as sent (auth, size, media type)."""


class UnauthorizedError(RequestRejectedError, PermissionError):
    """A bearer token is required and was missing or wrong."""


class ForbiddenError(RequestRejectedError, PermissionError):
    """The request asks for something this service is set not to do (say, system shared
    memory while it is off); the message names the setting."""


class NotFoundError(RequestRejectedError, LookupError):
    """No such model, version or shared-memory region here."""


class RequestTimeoutError(RequestRejectedError, TimeoutError):
    """The headers did not arrive within the header timeout, or the body arrived slower than
    the minimum rate; the connection is closed."""


class LengthRequiredError(RequestRejectedError, ValueError):
    """The request had no Content-Length; the body is sized from it before reading."""


class BodyTooLargeError(RequestRejectedError, ValueError):
    """The body is over the service's limit."""


class UnsupportedMediaTypeError(RequestRejectedError, ValueError):
    """The body is not `application/octet-stream`."""


class HeadersTooLargeError(RequestRejectedError, ValueError):
    """The request line and headers are over the service's cap; the connection is closed."""


class OverloadedError(ZenMLAError):
    """Try again later; `retry_after` seconds is the service's hint (None when unknown)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueFullError(OverloadedError):
    """The service's queue is full."""


class ServiceUnavailableError(OverloadedError):
    """The service is starting, draining or has no workers."""


class PoolClosedError(ServiceUnavailableError):
    """The worker pool is closed, or closed while the request waited or ran."""


class DeadlineExceededError(ZenMLAError, TimeoutError):
    """The request ran past its deadline; its work was abandoned."""


class KernelError(ZenMLAError, RuntimeError):
    """A kernel or worker failed on input that passed validation."""


class InternalError(ZenMLAError, RuntimeError):
    """A bug of the service: it failed on a request that may well be valid (the log holds the
    traceback). Not the kernel's fault, and not the request's: sending it again may work."""


class SharedMemoryUnavailableError(ZenMLAError):
    """A client asked for same-host regions (`shared_memory=True`) where the service offers
    none, or their socket cannot be reached from this host; the message says which."""


class ProtocolError(ZenMLAError):
    """The service's answer broke the protocol: names, shapes or dtypes other than the request
    asks for, an unreadable body, or more bytes than the request can need. Never retried."""


@dataclass(frozen=True, slots=True)
class ErrorCodes:
    """What the service answers one error class with, on every protocol.

    Args:
        error: the class; an error takes the first row whose class it is an instance of.
        http: its HTTP status (problem+json on `/prefill`, `{"error"}` on `/v2`).
        grpc: the name of its gRPC status code, a `grpc.StatusCode` member (zen_mla does not
            import grpc; the service looks the name up).
        client_raises: whether a client that reads `http` raises this class; one class a status.
    """

    error: type[ZenMLAError]
    http: int
    grpc: str
    client_raises: bool = False


ERROR_CODES: tuple[ErrorCodes, ...] = (
    ErrorCodes(WireFormatError, 400, "INVALID_ARGUMENT", client_raises=True),
    ErrorCodes(UnauthorizedError, 401, "UNAUTHENTICATED", client_raises=True),
    ErrorCodes(ForbiddenError, 403, "PERMISSION_DENIED", client_raises=True),
    ErrorCodes(NotFoundError, 404, "NOT_FOUND", client_raises=True),
    ErrorCodes(RequestTimeoutError, 408, "DEADLINE_EXCEEDED", client_raises=True),
    ErrorCodes(LengthRequiredError, 411, "INVALID_ARGUMENT", client_raises=True),
    ErrorCodes(BodyTooLargeError, 413, "RESOURCE_EXHAUSTED", client_raises=True),
    ErrorCodes(UnsupportedMediaTypeError, 415, "INVALID_ARGUMENT", client_raises=True),
    ErrorCodes(KernelUnavailableError, 422, "INVALID_ARGUMENT"),
    ErrorCodes(WorkTooLargeError, 422, "INVALID_ARGUMENT"),
    ErrorCodes(InvalidInputError, 422, "INVALID_ARGUMENT", client_raises=True),
    ErrorCodes(QueueFullError, 429, "RESOURCE_EXHAUSTED", client_raises=True),
    ErrorCodes(HeadersTooLargeError, 431, "RESOURCE_EXHAUSTED", client_raises=True),
    ErrorCodes(KernelError, 500, "INTERNAL", client_raises=True),
    ErrorCodes(InternalError, 500, "INTERNAL"),
    ErrorCodes(PoolClosedError, 503, "UNAVAILABLE"),
    ErrorCodes(ServiceUnavailableError, 503, "UNAVAILABLE", client_raises=True),
    ErrorCodes(DeadlineExceededError, 504, "DEADLINE_EXCEEDED", client_raises=True),
)
"""Most specific first: `codes_of` takes the first row an error is an instance of. Every
protocol's codes come from here; nothing else maps a class or a status to a code."""

# An error no row names (the base class, a client-side one) is a bug of the service's making.
_UNNAMED = next(row for row in ERROR_CODES if row.error is InternalError)

STATUS: dict[type[ZenMLAError], int] = {row.error: row.http for row in ERROR_CODES}
"""Each class's HTTP status, in the table's order (most specific first)."""

BY_STATUS: dict[int, type[ZenMLAError]] = {
    row.http: row.error for row in ERROR_CODES if row.client_raises
}
"""The class a client raises for each HTTP status the service answers an error with."""

ERROR_STATUSES: tuple[int, ...] = tuple(sorted({row.http for row in ERROR_CODES}))
"""Every HTTP status the service answers an error with, in order: what its routes document."""


def codes_of(exc: ZenMLAError) -> ErrorCodes:
    """The row `exc` is answered by: the first whose class it is an instance of, or
    InternalError's where no row names its class."""
    return next((row for row in ERROR_CODES if isinstance(exc, row.error)), _UNNAMED)


def status_of(exc: ZenMLAError) -> int:
    """The HTTP status `exc` is answered with (500 where the table does not name its class)."""
    return codes_of(exc).http


def parts_of(exc: BaseException) -> tuple[str, str, tuple[str, ...]]:
    """How an exception crosses a process boundary: its class name, its message, and for an
    InvalidInputError its (name, expected, got, hint)."""
    fields: tuple[str, ...] = ()
    if isinstance(exc, InvalidInputError):
        fields = (exc.name, exc.expected, exc.got, exc.hint)
    return type(exc).__name__, str(exc), fields


def from_parts(type_name: str, message: str, fields: tuple[str, ...]) -> ZenMLAError | None:
    """The exception `parts_of` described, as the class it was, where that class is one of
    this tree's; None for any other."""
    cls = globals().get(type_name)
    if not (isinstance(cls, type) and issubclass(cls, ZenMLAError) and type_name in __all__):
        return None
    if issubclass(cls, InvalidInputError):
        return cls(*fields) if len(fields) == 4 else None
    return cls(message)
