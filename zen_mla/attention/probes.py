"""This host's start-up probes: zentorch's presence and health and zen-mla's native kernel, each
run once per process against fp32 / fp64 references, gathered with the CPU's facts into the
`HostFacts` the kernels judge themselves by (`host_facts()`).

Apart from `host.py`, which holds the facts: the kernels read those, and the probes run the
kernels through the driver, so in one file they would make an import circle.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

import torch

from .batch import random_batch
from .driver import attend
from .host import HostFacts, cpu_facts
from .kernels import AttentionKernel, NativeKernel, ZentorchKernel
from .kernels.native import native_unavailable
from .kernels.zentorch import zentorch_op

__all__ = [
    "host_facts",
    "probe_host_facts",
    "probe_kernel",
    "probe_lse",
    "probe_op",
]


def probe_op(op: Any) -> str | None:
    """Run the op once on a small causal case; None if it agrees with fp32 math, else why not."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=gen) for _ in range(3))
    scale = 32**-0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    scores.masked_fill_(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ v
    try:
        got, _ = op(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.0, True, scale=scale)
    except Exception as exc:
        return f"zentorch_sdpa raised on this CPU: {exc}"
    err = (got.float() - expected).abs().max().item()
    if not err < 0.05:  # bf16 inputs: ~1e-2 is normal, and NaN fails too
        return f"zentorch_sdpa disagrees with fp32 math on this CPU (max error {err:.3g})"
    return None


@functools.cache
def _zentorch_probe() -> tuple[bool, str | None, bool, str | None]:
    try:
        version: str | None = importlib.metadata.version("zentorch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    op = zentorch_op()
    if op is None:
        why = "zentorch is not installed" if version is None else "zentorch has no zentorch_sdpa"
        return version is not None, version, False, why
    failure = probe_op(op)
    return True, version, failure is None, failure


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 out `[Sq, H, Dv]` and lse `[H, Sq]` of one sequence, bottom-right causal."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    sq, sk = q.shape[0], k.shape[0]
    if causal:
        hidden = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        scores.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]))  # rows with no key: 0
    return torch.einsum("hqk,khd->qhd", probs, v.double()), lse


#: (Sq, Sk) per sequence and causal: every path of the driver, MLA-like Dv < Dqk. Causal:
#: the square triangle, prefix-cached `Sq < Sk` (the additive mask), `Sq > Sk` (rows that see
#: no key) and a sequence with no keys; non-causal: `Sq != Sk` both ways.
_LSE_PROBE_CASES = (
    (((40, 40), (7, 29), (9, 4), (3, 0)), True, torch.bfloat16),
    (((5, 11), (12, 6)), False, torch.bfloat16),
    (((40, 40), (7, 29)), True, torch.float32),
)

#: the native kernel's, besides: more than one query block and key block per sequence (128 x
#: 256), a last block of one key, empty and one-token sequences, MLA's head dims
_NATIVE_PROBE_CASES = (
    (((40, 40), (7, 29), (9, 4), (3, 0), (0, 5), (1, 1)), True, torch.bfloat16),
    (((5, 11), (12, 6), (70, 257)), False, torch.bfloat16),
    (((130, 300), (300, 130)), True, torch.bfloat16),
)


def probe_lse() -> str | None:
    """zentorch's LSE route against fp64 (`probe_kernel`)."""
    return probe_kernel(ZentorchKernel, _LSE_PROBE_CASES, (2, 48, 32), "zentorch_sdpa's LSE route")


def probe_kernel(
    kernel: type[AttentionKernel],
    cases: tuple[tuple[tuple[tuple[int, int], ...], bool, torch.dtype], ...],
    heads: tuple[int, int, int],
    what: str,
) -> str | None:
    """Run `kernel` with its LSE through the ragged driver on the probe cases against fp64;
    None when every LSE is within 1e-3 (and -inf exactly where a query sees no key) and every
    `out` within its dtype's rounding, else what went wrong."""
    gen = torch.Generator().manual_seed(0)
    for lens, causal, dtype in cases:
        q_lens, kv_lens = [sq for sq, _ in lens], [sk for _, sk in lens]
        batch = random_batch(q_lens, kv_lens, heads, dtype, causal=causal, gen=gen)
        q, k, v, q_cu, kv_cu = (
            batch.q,
            batch.k,
            batch.v,
            batch.q_cu_seq_lens,
            batch.kv_cu_seq_lens,
        )
        case = f"{dtype} {'causal' if causal else 'non-causal'} (Sq, Sk) = {list(lens)}"
        try:
            out, lse = attend(batch, kernel, return_lse=True)
        except Exception as exc:
            return f"{what} raised on {case}: {exc}"
        assert lse is not None
        for i in range(len(lens)):
            qs, ks = slice(q_cu[i], q_cu[i + 1]), slice(kv_cu[i], kv_cu[i + 1])
            want_out, want_lse = _reference(q[qs], k[ks], v[ks], causal=causal, scale=batch.scale)
            got_lse = lse[:, qs].double()
            blind = torch.isinf(want_lse)
            if not torch.equal(torch.isinf(got_lse) & (got_lse < 0), blind):
                return f"{what}'s LSE is not -inf exactly where no key is seen, {case}"
            lse_err = _max_error(got_lse[~blind], want_lse[~blind])
            out_err = _max_error(out[qs].double(), want_out)
            out_tol = 0.05 if dtype == torch.bfloat16 else 1e-4
            if not (lse_err < 1e-3 and out_err < out_tol):  # NaN fails too
                return (
                    f"{what} disagrees with fp64 on {case}: lse error "
                    f"{lse_err:.3g} (allowed 1e-3), out error {out_err:.3g} (allowed {out_tol})"
                )
    return None


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) if want.numel() else 0.0


@functools.cache
def _native_probe() -> str | None:
    return native_unavailable() or probe_kernel(
        NativeKernel, _NATIVE_PROBE_CASES, (2, 192, 128), "zen-mla's native kernel"
    )


def probe_host_facts() -> HostFacts:
    """What this host offers, probed now (~30 ms); `host_facts()` keeps the first answer."""
    installed, version, op_ok, failure = _zentorch_probe()
    return HostFacts(
        cpu=cpu_facts(),
        zentorch_installed=installed,
        zentorch_version=version,
        zentorch_failure=failure,
        zentorch_lse_failure=probe_lse() if op_ok else failure,
        native_failure=_native_probe(),
    )


@functools.cache
def host_facts() -> HostFacts:
    """What this host offers, probed once per process."""
    return probe_host_facts()
