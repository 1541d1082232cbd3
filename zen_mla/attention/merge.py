"""Merging partial attention results by their log-sum-exp, as vLLM's `merge_attn_states`.

Attention over a sequence's keys split into disjoint parts (new tokens causal, cached context in
chunks non-causal) is each part's `out` weighted by `exp(lse_part - lse_all)`, where `lse_all`
is the log-sum-exp of the parts' LSEs. Every LSE here is `[H, T]`, natural log, and every
output `[T, H, D]`, as vLLM lays them out.

    merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse)
    merge_many([out_a, out_b, out_c], [lse_a, lse_b, lse_c], output=out)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidInputError

__all__ = ["merge_attn_states", "merge_many"]


def _shape(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _check(
    output: torch.Tensor,
    outputs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    output_lse: torch.Tensor | None,
    names: Sequence[tuple[str, str]],
) -> None:
    if output.ndim != 3:
        raise InvalidInputError("output", "[T, H, D]", _shape(output))
    t, h, _d = output.shape
    for (o_name, l_name), o, lse in zip(names, outputs, lses, strict=True):
        if o.shape != output.shape:
            raise InvalidInputError(o_name, f"output's shape {list(output.shape)}", _shape(o))
        if lse.shape != (h, t):
            raise InvalidInputError(l_name, f"[H, T] = {[h, t]}", _shape(lse))
        if not lse.is_floating_point():
            raise InvalidInputError(l_name, "a floating point LSE", _shape(lse))
    if output_lse is not None and output_lse.shape != (h, t):
        raise InvalidInputError("output_lse", f"[H, T] = {[h, t]}", _shape(output_lse))


def _merge(
    output: torch.Tensor,
    outputs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    output_lse: torch.Tensor | None,
) -> None:
    # fp32 at least (fp64 stays fp64): bf16 weights would cost 3 significant digits.
    dtype = torch.float64 if any(o.dtype == torch.float64 for o in outputs) else torch.float32
    # FA2 reports a part with no keys as +inf, FA3 and zen-mla as -inf: both mean "nothing".
    stacked = torch.stack([lse.to(dtype) for lse in lses])  # [P, H, T]
    stacked = stacked.masked_fill(stacked == float("inf"), float("-inf"))
    top = stacked.amax(dim=0)
    # All parts empty: top is -inf and `lse - top` would be nan; shift by 0 instead, so every
    # weight is exp(-inf) = 0, the output 0 and the merged LSE log(0) = -inf.
    top = top.masked_fill(torch.isneginf(top), 0.0)
    weights = torch.exp(stacked - top)  # [P, H, T]
    total = weights.sum(dim=0)
    # Scale first, then multiply the outputs (as vLLM does): no exp() of a raw LSE overflows.
    weights = weights / total.masked_fill(total == 0, 1.0)
    merged = torch.zeros(output.shape, dtype=dtype, device=output.device)
    for o, w in zip(outputs, weights, strict=True):
        merged.addcmul_(o.to(dtype), w.transpose(0, 1).unsqueeze(-1))
    output.copy_(merged)
    if output_lse is not None:
        output_lse.copy_(torch.log(total) + top)


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
) -> None:
    """vLLM's `merge_attn_states`: attention over prefix and suffix keys from each part's.

    Args:
        output: `[T, H, D]`, written in place (any float dtype; computed in fp32 or wider).
        prefix_output, suffix_output: `[T, H, D]`, the parts' outputs.
        prefix_lse, suffix_lse: `[H, T]` float, natural-log LSEs; `+inf` is read as `-inf`
            (what FA2 reports for no keys), `-inf` means the part saw no key.
        output_lse: `[H, T]`, written with the merged LSE when given.

    A token whose parts both saw no key gets `output = 0` and `output_lse = -inf`.

    Raises:
        InvalidInputError (a ValueError) naming the tensor whose shape does not fit.
    """
    outputs, lses = (prefix_output, suffix_output), (prefix_lse, suffix_lse)
    names = (("prefix_output", "prefix_lse"), ("suffix_output", "suffix_lse"))
    _check(output, outputs, lses, output_lse, names)
    _merge(output, outputs, lses, output_lse)


def merge_many(
    outputs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    *,
    output: torch.Tensor | None = None,
    output_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of parts at once (one rounding, not one per pairwise merge).

    Args:
        outputs: `P >= 1` tensors `[T, H, D]`.
        lses: `P` tensors `[H, T]` float, natural log, as in `merge_attn_states`.
        output: `[T, H, D]` to write into; default a new tensor of `outputs[0]`'s dtype.
        output_lse: `[H, T]` to write the merged LSE into; default a new fp32 tensor (fp64
            where a part is fp64).

    Returns:
        `(output, output_lse)`.
    """
    if not outputs or len(outputs) != len(lses):
        raise InvalidInputError(
            "outputs, lses", "as many LSEs as outputs, one or more", f"{len(outputs)}, {len(lses)}"
        )
    if output is None:
        output = torch.empty_like(outputs[0])
    if output_lse is None:
        wide = any(o.dtype == torch.float64 for o in outputs)
        dtype = torch.float64 if wide else torch.float32
        output_lse = torch.empty(lses[0].shape, dtype=dtype, device=lses[0].device)
    names = [(f"outputs[{i}]", f"lses[{i}]") for i in range(len(outputs))]
    _check(output, outputs, lses, output_lse, names)
    _merge(output, outputs, lses, output_lse)
    return output, output_lse
