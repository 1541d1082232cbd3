"""zen-mla: ragged MLA prefill attention on AMD EPYC CPUs, as a library and a service.

Importing the package does not import torch: worker processes must set their CPU affinity and
thread environment first. The names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import *  # noqa: F403  (the one exception tree is the package's face)

if TYPE_CHECKING:
    from .attention import KernelChoice, kernel_choice, ragged_attention, zentorch_status

__all__ = ["KernelChoice", "kernel_choice", "ragged_attention", "zentorch_status"]
__all__ += errors.__all__

__version__ = "0.1.0"

_LAZY = {
    "KernelChoice": ".attention",
    "kernel_choice": ".attention",
    "ragged_attention": ".attention",
    "zentorch_status": ".attention",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
