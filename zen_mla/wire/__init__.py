"""Wire formats, read and written in one place each:

    dtypes.py        the one dtype table (safetensors and Open Inference Protocol names)
    safetensors.py   the `/prefill` body and answer (safetensors), request options
    regions_json.py  the `/prefill` body naming places in same-host regions

The names below are safetensors.py's, the format most callers want (`wire.encode`).
"""

from __future__ import annotations

from . import dtypes, regions_json, safetensors
from .safetensors import *  # noqa: F403  (the format most callers want)

__all__ = ["dtypes", "regions_json", "safetensors"]
__all__ += safetensors.__all__
