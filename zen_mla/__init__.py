"""zen-mla: ragged MLA prefill attention on AMD EPYC CPUs, as a library and a service."""

from ._attention import ragged_attention
from ._errors import (
    InvalidInputError,
    KernelError,
    KernelUnavailableError,
    WorkTooLargeError,
    ZenMLAError,
)
from ._status import zentorch_status

__all__ = [
    "InvalidInputError",
    "KernelError",
    "KernelUnavailableError",
    "WorkTooLargeError",
    "ZenMLAError",
    "ragged_attention",
    "zentorch_status",
]

__version__ = "0.1.0"
