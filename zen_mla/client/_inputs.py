"""A prefill call's tensors as `prefill` takes them, checked before anything is sent: each is
what the contract asks for, or InvalidInputError names the first that is not."""

from __future__ import annotations

import torch

from ..errors import InvalidInputError
from ..wire.dtypes import BY_SAFETENSORS, BY_TORCH

__all__ = ["checked_tensors"]


def checked_tensors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The request's tensors by the contract's names (kv_cu_seq_lens only where given): torch
    tensors, q, k and v 3-D, cu_seq_lens 1-D integers of one length, every dtype one the wire
    carries."""
    tensors = {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu_seq_lens}
    if kv_cu_seq_lens is not None:
        tensors["kv_cu_seq_lens"] = kv_cu_seq_lens
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(name, "a torch.Tensor", type(t).__name__)
        if name in ("q", "k", "v") and t.ndim != 3:
            raise InvalidInputError(name, "a 3-D tensor [T, H, D]", f"shape {tuple(t.shape)}")
        # cu_seq_lens are read here to weigh the request (`_endpoints.weigh`): checked first
        whole = t.ndim == 1 and t.shape[0] >= 1 and t.dtype in (torch.int32, torch.int64)
        if name.endswith("cu_seq_lens") and not whole:
            got = f"{t.dtype} of shape {tuple(t.shape)}"
            raise InvalidInputError(name, "a 1-D int32 or int64 tensor [B + 1]", got)
        if t.dtype not in BY_TORCH:
            raise InvalidInputError(
                name, f"a dtype among {', '.join(BY_SAFETENSORS)}", str(t.dtype)
            )
    if kv_cu_seq_lens is not None and kv_cu_seq_lens.shape != q_cu_seq_lens.shape:
        raise InvalidInputError(
            "kv_cu_seq_lens",
            f"[B + 1] = {list(q_cu_seq_lens.shape)}, as q_cu_seq_lens",
            str(list(kv_cu_seq_lens.shape)),
        )
    return tensors
