"""AMD zentorch's fused attention: scale, mask, softmax and both matmuls in one call."""

from __future__ import annotations

import functools
import importlib
from dataclasses import replace
from typing import Any, ClassVar

import torch

from ..host import HostFacts
from .base import AttentionKernel, CallShape, KernelCall

__all__ = ["ZentorchKernel", "zentorch_op"]


@functools.cache
def zentorch_op() -> Any | None:
    """`torch.ops.zentorch.zentorch_sdpa` after importing zentorch, or None where absent."""
    try:
        importlib.import_module("zentorch")
    except Exception:  # ImportError, or a wheel built for another torch failing to load
        return None
    namespace = getattr(torch.ops, "zentorch", None)
    return getattr(namespace, "zentorch_sdpa", None) if namespace is not None else None


class ZentorchKernel(AttentionKernel):
    """`torch.ops.zentorch.zentorch_sdpa`.

    zentorch 2.13 has two implementations behind the op, picked per call: ZenDNN's direct SDPA
    (inference only; its second return is uninitialised memory) and, when autograd records the
    call, the plugin's own flash kernel, whose second return is the real natural-log LSE
    (`[n, H, Sq]` fp32). `out` without an LSE takes the first, `out` with an LSE the second;
    neither is a documented promise, so the LSE is used only where the selector's start-up
    probe (`attention.probes`) found it correct. Its `is_causal` is top-left aligned and it
    refuses bool masks: the driver passes bottom-right causal masks as additive masks of the
    query dtype.
    """

    name: ClassVar[str] = "zentorch"
    needs_equal_head_dims: ClassVar[bool] = True
    # fp16 runs, but at bf16 precision (max error ~9x same-precision PyTorch's, measured)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float32)
    auto_reason: ClassVar[str] = "zentorch_sdpa works (it passed the start-up probe)"
    lse_reason: ClassVar[str] = "zentorch_sdpa's LSE route passed the start-up probe against fp64"

    @classmethod
    def unavailable_reason(cls, host: HostFacts) -> str | None:
        return host.zentorch_failure

    @classmethod
    def lse_unavailable_reason(cls, host: HostFacts) -> str | None:
        return host.zentorch_lse_failure

    @classmethod
    def call_bytes(cls, shape: CallShape, threads: int) -> int:
        # Its LSE route copies V when all three inputs are the caller's inference tensors.
        v_copy = shape.n * shape.heads * shape.sk * shape.dv * shape.itemsize
        return shape.flash_bytes(threads) + (v_copy if shape.return_lse else 0)

    @classmethod
    def forward(cls, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Strided [n, H, S, D] views of the ragged [T, H, D] tensors are read in place: the
        # kernel takes any strides, so no per-sequence .contiguous() as in vLLM's loop.
        if not call.return_lse:
            out, _garbage = zentorch_sdpa(call)
            return out, None
        return zentorch_sdpa_with_lse(call)


def zentorch_sdpa(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's two returns (the second is garbage on ZenDNN's route)."""
    op = zentorch_op()
    assert op is not None, "called only where the selector found the op"
    out, second = op(
        call.q, call.k, call.v, 0.0, call.causal, attn_mask=call.mask, scale=call.scale
    )
    return out, second


def zentorch_sdpa_with_lse(call: KernelCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's flash route, which writes its LSE: taken when grad mode is on and an input
    requires grad. Nothing is differentiated; the graph dies with the outputs' detach."""
    q, k, v = call.q, call.k, call.v
    with torch.inference_mode(False), torch.enable_grad():
        # Inference tensors (a caller under torch.inference_mode) cannot require grad; V is
        # usually the driver's padded copy, made outside inference mode. Where all three are
        # the caller's inference tensors, one copy of V is the price of the route.
        if not v.is_inference():
            v = v.detach().requires_grad_()
        elif not k.is_inference():
            k = k.detach().requires_grad_()
        elif not q.is_inference():
            q = q.detach().requires_grad_()
        else:
            v = v.clone().requires_grad_()
        out, lse = zentorch_sdpa(replace(call, q=q, k=k, v=v))
    return out.detach(), lse.detach()
