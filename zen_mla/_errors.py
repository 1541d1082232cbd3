"""The exceptions zen_mla raises, in one tree.

    ZenMLAError
    ├── InvalidInputError (ValueError)   a tensor or argument breaks the contract -> HTTP 422
    │   ├── KernelUnavailableError       a kernel was forced where it cannot run
    │   └── WorkTooLargeError            the request's work is over the configured cap
    ├── KernelError (RuntimeError)       a kernel or worker failed on valid input -> HTTP 500
    └── PoolClosedError (RuntimeError)   the worker pool is shut down or shutting down -> HTTP 503

Every error crossing a boundary (worker -> library, library -> HTTP, HTTP -> client) is mapped
through the table in the module that owns that boundary, never ad hoc.
"""

from __future__ import annotations

__all__ = [
    "InvalidInputError",
    "KernelError",
    "KernelUnavailableError",
    "PoolClosedError",
    "WorkTooLargeError",
    "ZenMLAError",
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
        message = f"{name}: expected {expected}, got {got}"
        if hint:
            message = f"{message}. {hint}"
        super().__init__(message)


class KernelUnavailableError(InvalidInputError):
    """A kernel was asked for by name where it cannot run (not installed, or fails its probe)."""


class WorkTooLargeError(InvalidInputError):
    """The request's attention work is over the configured cap."""


class KernelError(ZenMLAError, RuntimeError):
    """A kernel or worker failed on input that passed validation."""


class PoolClosedError(ZenMLAError, RuntimeError):
    """The worker pool is closed, or closed while the request waited or ran."""
