"""Tensors for the Open Inference Protocol's clients: torch <-> numpy, BF16 as
`ml_dtypes.bfloat16` (tritonclient's BF16 since 2.73)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy().copy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).bfloat16()
    return torch.from_numpy(np.array(a))  # a writable copy (binary outputs are read-only)
