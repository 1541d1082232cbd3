"""Wire formats, read and written in one place each:

    dtypes.py        the one dtype table (safetensors and Open Inference Protocol names)
    safetensors.py   the `/prefill` body and answer (safetensors), request options
    regions_json.py  the `/prefill` body naming places in same-host regions

The names below are safetensors.py's, the format most callers want (`wire.encode`).
"""

from __future__ import annotations

from .safetensors import (
    MAX_DIM,
    MAX_HEADER_BYTES,
    MAX_METADATA_VALUE,
    MAX_REQUEST_ID,
    REQUEST_TENSORS,
    RESPONSE_TENSORS,
    PrefillOptions,
    check_request_id,
    decode,
    encode,
    header_length,
    options_metadata,
    parse_options,
    tensor_bytes,
)

__all__ = [
    "MAX_DIM",
    "MAX_HEADER_BYTES",
    "MAX_METADATA_VALUE",
    "MAX_REQUEST_ID",
    "REQUEST_TENSORS",
    "RESPONSE_TENSORS",
    "PrefillOptions",
    "check_request_id",
    "decode",
    "encode",
    "header_length",
    "options_metadata",
    "parse_options",
    "tensor_bytes",
]
