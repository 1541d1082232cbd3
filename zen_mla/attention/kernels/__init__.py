"""Attention kernels, one file each, by name. Which one runs is `attention.select`'s choice."""

from __future__ import annotations

from .base import AttentionKernel, CallShape, KernelCall
from .native import NativeKernel
from .reference import ReferenceKernel
from .torch_flash import TorchFlashKernel
from .zentorch import ZentorchKernel

__all__ = [
    "KERNELS",
    "AttentionKernel",
    "CallShape",
    "KernelCall",
    "NativeKernel",
    "ReferenceKernel",
    "TorchFlashKernel",
    "ZentorchKernel",
]

#: the registered kernels by name, in order of preference: "auto" takes the first that runs
#: here, suits "auto" and computes the request's dtype at its own precision
KERNELS: dict[str, type[AttentionKernel]] = {
    k.name: k for k in (NativeKernel, ZentorchKernel, TorchFlashKernel, ReferenceKernel)
}
