"""The varlen ("ragged") batch: the contract's rules, checked once at the edge.

Inner code takes a `RaggedBatch` and trusts it: shapes agree, `cu_seq_lens` are valid offsets,
the scale is a positive finite number.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError
from ..wire.dtypes import INDEX_DTYPES, VALUE_DTYPES

__all__ = [
    "DTYPES",
    "SMALL_BATCH",
    "RaggedBatch",
    "Run",
    "check_num_seqs",
    "check_offsets",
    "check_out",
    "check_scale",
    "check_tensor",
    "random_batch",
    "total_visible_pairs",
    "validate",
    "visible_pairs",
]

DTYPES = VALUE_DTYPES  # what q, k and v may be


#: offsets up to which a batch's offsets are checked and summed in Python: below it a loop costs
#: less than the tensor operations' fixed cost (a few µs each), which a 1-token call pays ~10 of
SMALL_BATCH = 64


def visible_pairs(sq: int, sk: int, causal: bool) -> int:
    """(query, key) pairs a sequence computes; causal is bottom-right aligned (query i sees keys
    j <= i + sk - sq)."""
    if not causal:
        return sq * sk
    seen = min(sq, sk)
    return seen * (sk - seen) + seen * (seen + 1) // 2


def total_visible_pairs(
    q_cu_seq_lens: Sequence[int], kv_cu_seq_lens: Sequence[int], causal: bool
) -> int:
    """`visible_pairs` summed over a batch's sequences: in Python for a few sequences, else in one
    pass of int64 tensor arithmetic (exact below 2^63: offsets are below 2^48 and a service caps
    the work far lower)."""
    if len(q_cu_seq_lens) <= SMALL_BATCH:
        return sum(
            visible_pairs(
                q_cu_seq_lens[r + 1] - q_cu_seq_lens[r], kv_cu_seq_lens[r + 1] - kv, causal
            )
            for r, kv in enumerate(kv_cu_seq_lens[:-1])
        )
    qc = torch.tensor(q_cu_seq_lens, dtype=torch.int64)
    kc = torch.tensor(kv_cu_seq_lens, dtype=torch.int64)
    sq, sk = qc[1:] - qc[:-1], kc[1:] - kc[:-1]
    if not causal:
        return int((sq * sk).sum())
    seen = torch.minimum(sq, sk)
    return int((seen * (sk - seen) + seen * (seen + 1) // 2).sum())


@dataclass(frozen=True, slots=True)
class Run:
    """`count` consecutive sequences of one shape: queries `[q_start, q_start + count * sq)`,
    keys/values `[kv_start, kv_start + count * sk)`. Equal-shape neighbours are handed to a kernel
    as one `[count, H, S, D]` batch, a strided view of the ragged tensors (no copy)."""

    q_start: int
    kv_start: int
    sq: int
    sk: int
    count: int


@dataclass(frozen=True, slots=True)
class RaggedBatch:
    """A validated varlen batch.

    q: `[Tq, H, Dqk]`, k: `[Tk, H, Dqk]`, v: `[Tk, H, Dv]` with `Dv <= Dqk`, one dtype of
    bf16/fp16/fp32, on the CPU, last dim contiguous. `q_cu_seq_lens`/`kv_cu_seq_lens`: `B + 1`
    offsets as Python ints. `scale`: positive and finite.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_cu_seq_lens: tuple[int, ...]
    kv_cu_seq_lens: tuple[int, ...]
    causal: bool
    scale: float

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[1])

    @property
    def qk_head_dim(self) -> int:
        return int(self.q.shape[2])

    @property
    def v_head_dim(self) -> int:
        return int(self.v.shape[2])

    @property
    def num_seqs(self) -> int:
        """B, the batch's sequences."""
        return len(self.q_cu_seq_lens) - 1

    @property
    def num_requests(self) -> int:
        """Deprecated name of `num_seqs` (a batch's rows are sequences; a request is what the
        service is asked); removed in 0.3."""
        warnings.warn(
            "RaggedBatch.num_requests is deprecated: use num_seqs", DeprecationWarning, stacklevel=2
        )
        return self.num_seqs

    def runs(self) -> Iterator[Run]:
        """Sequences grouped into maximal runs of equal `(Sq, Sk)`, in order."""
        qc, kc = self.q_cu_seq_lens, self.kv_cu_seq_lens
        r, b = 0, self.num_seqs
        while r < b:
            sq, sk = qc[r + 1] - qc[r], kc[r + 1] - kc[r]
            n = 1
            while r + n < b and qc[r + n + 1] - qc[r + n] == sq and kc[r + n + 1] - kc[r + n] == sk:
                n += 1
            yield Run(qc[r], kc[r], sq, sk, n)
            r += n

    def work(self) -> int:
        """Multiply-adds of the score matmul, `H * Dqk * sum(Sq * Sk)`, about halved for causal."""
        return (
            self.num_heads
            * self.qk_head_dim
            * total_visible_pairs(self.q_cu_seq_lens, self.kv_cu_seq_lens, self.causal)
        )


def check_tensor(name: str, t: object, layout: str) -> torch.Tensor:
    """`t`, a CPU tensor of one of DTYPES with a dimension for each of `layout`'s
    (`"[Tq, H, Dqk]"`); InvalidInputError naming `name` otherwise."""
    ndim = layout.count(",") + 1
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(name, f"a torch.Tensor {layout}", type(t).__name__)
    if t.device.type != "cpu":
        raise InvalidInputError(
            name, "a CPU tensor", f"a tensor on {t.device}", "Move it with .cpu() first"
        )
    if t.ndim != ndim:
        raise InvalidInputError(name, f"a {ndim}-D tensor {layout}", f"shape {tuple(t.shape)}")
    if t.dtype not in DTYPES:
        raise InvalidInputError(name, "dtype bfloat16, float16 or float32", str(t.dtype))
    return t


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()  # kernels read rows with unit stride


def check_num_seqs(name: str, entries: int, max_seqs: int | None) -> None:
    """`entries` offsets (B + 1) of a cu_seq_lens tensor are within the cap of `max_seqs`
    sequences: checked before anything is read per sequence."""
    if max_seqs is not None and entries - 1 > max_seqs:
        raise InvalidInputError(
            name,
            f"at most {max_seqs} sequences (B + 1 <= {max_seqs + 1} offsets; the service's "
            "max_seqs)",
            f"{entries} offsets",
            "Split the batch into smaller requests",
        )


def _check_cu_seq_lens(
    name: str, cu: object, total: int, total_name: str, max_seqs: int | None
) -> tuple[int, ...]:
    if not isinstance(cu, torch.Tensor):
        raise InvalidInputError(name, "a torch.Tensor [B + 1]", type(cu).__name__)
    if cu.ndim != 1 or cu.numel() < 1:
        raise InvalidInputError(
            name, "a 1-D tensor [B + 1] with B >= 0", f"shape {tuple(cu.shape)}"
        )
    if cu.dtype not in INDEX_DTYPES:
        raise InvalidInputError(name, "dtype int32 or int64", str(cu.dtype))
    check_num_seqs(name, cu.numel(), max_seqs)
    if cu.numel() <= SMALL_BATCH:
        offsets = cu.tolist()
        i = next((i for i in range(1, len(offsets)) if offsets[i] < offsets[i - 1]), None)
    else:  # one pass in torch, not a Python loop per sequence
        c = cu.to(torch.int64)
        falls = torch.nonzero(c[1:] < c[:-1])
        i = int(falls[0, 0]) + 1 if falls.numel() else None
        offsets = c.tolist()
    if offsets[0] != 0:
        raise InvalidInputError(name, f"{name}[0] == 0", f"{name}[0] == {offsets[0]}")
    if i is not None:
        raise InvalidInputError(
            name,
            "non-decreasing offsets",
            f"{name}[{i}] = {offsets[i]} < {name}[{i - 1}] = {offsets[i - 1]}",
        )
    if offsets[-1] != total:
        raise InvalidInputError(
            name,
            f"{name}[-1] == {total_name} = {total}",
            f"{name}[-1] = {offsets[-1]}",
            "The last offset is the total token count of the ragged tensor",
        )
    return tuple(offsets)


def validate(
    q: object,
    k: object,
    v: object,
    q_cu_seq_lens: object,
    kv_cu_seq_lens: object | None,
    *,
    causal: bool,
    scale: float | None,
    max_seqs: int | None = None,
) -> RaggedBatch:
    """Check every rule of the contract; raise `InvalidInputError` naming the first one broken.
    `max_seqs` caps the sequences of the batch (a service's limit; None: no cap)."""
    q = _rows(check_tensor("q", q, "[Tq, H, Dqk]"))
    k = _rows(check_tensor("k", k, "[Tk, H, Dqk]"))
    v = _rows(check_tensor("v", v, "[Tk, H, Dv]"))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidInputError("k, v", f"the dtype of q ({q.dtype})", f"k {k.dtype}, v {v.dtype}")
    tq, h, dqk = q.shape
    if h < 1 or dqk < 1:
        raise InvalidInputError("q", "H >= 1 and Dqk >= 1", f"shape {tuple(q.shape)}")
    if k.shape[1] != h or k.shape[2] != dqk:
        raise InvalidInputError(
            "k", f"[Tk, H={h}, Dqk={dqk}] (heads and head dim of q)", f"shape {tuple(k.shape)}"
        )
    if v.shape[0] != k.shape[0] or v.shape[1] != h:
        raise InvalidInputError(
            "v",
            f"[Tk={k.shape[0]}, H={h}, Dv] (tokens of k, heads of q)",
            f"shape {tuple(v.shape)}",
        )
    if not 1 <= v.shape[2] <= dqk:
        raise InvalidInputError("v", f"head dim 1 <= Dv <= Dqk = {dqk}", f"Dv = {v.shape[2]}")
    q_cu, kv_cu = check_offsets(
        q_cu_seq_lens, kv_cu_seq_lens, tq, int(k.shape[0]), keys="k", max_seqs=max_seqs
    )
    return RaggedBatch(q, k, v, q_cu, kv_cu, bool(causal), check_scale(scale, dqk))


def check_offsets(
    q_cu_seq_lens: object,
    kv_cu_seq_lens: object | None,
    tq: int,
    tk: int,
    *,
    keys: str,
    max_seqs: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The offsets of a batch of `tq` queries over `tk` keys (the tensor `keys` names): each
    `[B + 1]`, from 0, non-decreasing, to its total; `kv_cu_seq_lens` None only where the
    counts are the same. InvalidInputError naming the first rule broken."""
    q_cu = _check_cu_seq_lens("q_cu_seq_lens", q_cu_seq_lens, tq, "Tq", max_seqs)
    if kv_cu_seq_lens is None:
        if tk != tq:
            raise InvalidInputError(
                "kv_cu_seq_lens",
                f"a tensor when {keys} has a different token count than q",
                f"None with Tq = {tq}, Tk = {tk}",
            )
        return q_cu, q_cu
    kv_cu = _check_cu_seq_lens("kv_cu_seq_lens", kv_cu_seq_lens, tk, "Tk", max_seqs)
    if len(kv_cu) != len(q_cu):
        raise InvalidInputError(
            "kv_cu_seq_lens",
            f"{len(q_cu)} offsets (B + 1, as q_cu_seq_lens)",
            f"{len(kv_cu)} offsets",
        )
    return q_cu, kv_cu


def check_scale(scale: object, dqk: int) -> float:
    """The score scale: `dqk ** -0.5` for None, else a finite number > 0."""
    if scale is None:
        return float(dqk**-0.5)
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise InvalidInputError("scale", "a float or None", type(scale).__name__)
    if not (math.isfinite(scale) and scale > 0):
        raise InvalidInputError("scale", "a finite number > 0", repr(scale))
    return float(scale)


def check_out(out: object, q: torch.Tensor, v: torch.Tensor) -> None:
    """`out` can take a batch's result in place: `[Tq, H, Dv]` in v's dtype (any device, any
    strides); InvalidInputError naming `out` otherwise."""
    if not isinstance(out, torch.Tensor):
        raise InvalidInputError("out", "a torch.Tensor", type(out).__name__)
    want = (q.shape[0], q.shape[1], v.shape[-1])
    if tuple(out.shape) != want or out.dtype != v.dtype:
        dtype = str(v.dtype).removeprefix("torch.")
        got = f"{list(out.shape)} {str(out.dtype).removeprefix('torch.')}"
        raise InvalidInputError("out", f"{list(want)} {dtype} (v's dtype)", got)


def random_batch(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    *,
    causal: bool,
    gen: torch.Generator,
) -> RaggedBatch:
    """A validated batch of standard-normal q, k and v (`heads` = (H, Dqk, Dv), drawn from `gen`
    in that order, then cast to `dtype`): the start-up probes' and the calibration's."""
    h, dqk, dv = heads
    q_cu = torch.tensor([0, *itertools.accumulate(q_lens)])
    kv_cu = torch.tensor([0, *itertools.accumulate(kv_lens)])
    q = torch.randn(int(q_cu[-1]), h, dqk, generator=gen).to(dtype)
    k = torch.randn(int(kv_cu[-1]), h, dqk, generator=gen).to(dtype)
    v = torch.randn(int(kv_cu[-1]), h, dv, generator=gen).to(dtype)
    return validate(q, k, v, q_cu, kv_cu, causal=causal, scale=None)
