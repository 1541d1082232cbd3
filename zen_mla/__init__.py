"""zen-mla: ragged MLA prefill attention on AMD EPYC CPUs, as a library and a service.

Importing the package does not import torch: worker processes must set their CPU affinity and
thread environment first. The names below load on first use.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from . import errors
from ._lazy import lazy_names
from .errors import *  # noqa: F403  (the one exception tree is the package's face)

if TYPE_CHECKING:
    from .attention import (
        KernelChoice,
        host_kernels,
        kernel_choice,
        ragged_attention,
        zentorch_status,
    )
    from .attention.latent import latent_attention

__all__ = [
    "KernelChoice",
    "__version__",
    "host_kernels",
    "kernel_choice",
    "latent_attention",
    "ragged_attention",
    "zentorch_status",  # deprecated: host_kernels()
]
__all__ += errors.__all__

try:  # pyproject.toml's, as the install recorded it
    __version__ = importlib.metadata.version("zen-mla")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

_LAZY = {
    "KernelChoice": ".attention",
    "host_kernels": ".attention",
    "kernel_choice": ".attention",
    "latent_attention": ".attention.latent",
    "ragged_attention": ".attention",
    "zentorch_status": ".attention",
}

__getattr__ = lazy_names(__name__, _LAZY)
