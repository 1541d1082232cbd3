"""Names a package offers without importing what holds them until first use (the package's
`__getattr__`, PEP 562): importing zen_mla, its pool or its regions must not import torch or a
server's end before a caller needs them (a worker sets its CPU affinity and thread environment
before torch loads)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of `package` for the names in `where` (name -> module, relative to
    the package)."""

    def getattr_(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return getattr_
