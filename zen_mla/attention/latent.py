"""MLA attention from the latent cache: `latent_attention` over a ragged batch whose keys and
values are a DeepSeek layer's cached latent `kv_c` and shared rope key `k_pe`, with the layer's
`kv_b_proj` weight, in one of two forms per sequence.

With R = kv_lora_rank (512), P = the rope dims (64), Dn = the no-rope query dims (128), Dv = the
value dims (128), Dqk = Dn + P, and M new tokens of a sequence, per key and head:

    expand  each key block's k_nope and v made from its latent block (all heads in one matmul)
            as the flash loop reaches it, then Dqk/Dv attention: 2 R (Dn + Dv) + 2 (Dqk + Dv) M
            = 262,144 + 640 M FLOP
    absorb  W_k folded into the queries and W_v into the output: attention of (R + P)-dim
            queries against the latent key [kv_c, k_pe] every head shares, (R)-dim values:
            2 (R + P) M + 2 R M = 2,176 M FLOP

Products, `precision`:

    bf16    "auto" on bf16 inputs where the CPU has bf16 arithmetic and zen-mla's native kernel
            runs its AVX-512 BF16 path (`bf16_unavailable()` is None): expand makes each key
            block's k and v with one bf16 matmul (fp32 sums, rounded to bf16 as vLLM's
            expansion rounds them) and hands them with all the sequence's queries to the native
            kernel, the blocks' results merged by their LSEs; absorb folds W_k into the queries
            in bf16 and hands every head's folded queries, as the rows of one head, to the
            native kernel against [kv_c, k_pe]. The rounding of k_nope (or of the folded query)
            to bf16 moves the LSE by up to ~3e-3 (the baseline's own error); where the LSE is
            asked, that move is taken off to first order (~1e-5 left): the rounding's residual
            rides beside v as Dn more value columns (expand; one more bf16 matmul, and the
            kernel's value work doubled) or is dotted with the kernel's latent out (absorb).
            `precision="bf16"` leaves the move.
    fp32    everything else, or `precision="fp32"`: every product in fp32 on fp32 copies of the
            blocks, a flash loop in torch (a bf16 `torch.matmul` is a scalar loop on CPUs
            without bf16 arithmetic: 0.3 GFLOP/s on an EPYC Zen 3).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Literal, overload

import torch

from ..errors import InvalidInputError
from .batch import check_offsets, check_scale, check_tensor
from .host import cpu_facts

__all__ = [
    "ABSORB_CONTEXT_KNEE",
    "ABSORB_ROWS",
    "CROSSOVER",
    "CROSSOVER_FP32",
    "CROSSOVER_LSE",
    "FORMS",
    "KEY_BLOCK",
    "NATIVE_BLOCK_BYTES",
    "NATIVE_BLOCK_BYTES_PER_QUERY",
    "NATIVE_BLOCK_MAX_BYTES",
    "PRECISIONS",
    "SCORE_BUDGET_BYTES",
    "Form",
    "LatentBatch",
    "Precision",
    "bf16_unavailable",
    "latent_attention",
    "validate_latent",
]

Form = Literal["expand", "absorb", "auto"]
FORMS: tuple[Form, ...] = ("expand", "absorb", "auto")
Precision = Literal["auto", "bf16", "fp32"]
PRECISIONS: tuple[Precision, ...] = ("auto", "bf16", "fp32")

#: new tokens of a sequence from which "auto" expands rather than absorbs, with bf16 products
#: (`precision="auto"` on bf16 inputs where `bf16_unavailable()` is None), in the limit of a
#: long context: a sequence of M new tokens after C cached ones (C = Sk - M causal, Sk not)
#: absorbs where M < CROSSOVER x C / (C + `ABSORB_CONTEXT_KNEE`), 179 at a 16k context, 144 at
#: 2k, 86 at 512, none at 0 (`engine.latent_work` takes M < CROSSOVER), the LSE not asked
#: (`CROSSOVER_LSE` where it is). Measured on an AMD EPYC Zen 5 (2 vCPUs, 16 heads,
#: DeepSeek-V3's dims, paired medians, `bench/latent.py --crossover`): at 16k, absorb / expand
#: 0.86 at M = 160, 1.02 at 192 (quiet host; 0.94 and 1.07 with a busy neighbour); the forms
#: meet near M = 150 at 2k, 110 at 1k, 80 at 512, 55 at 256, 20-30 at 128, and absorbing is 3x
#: slower at every M without context
CROSSOVER = 186

#: `CROSSOVER` where the LSE is asked: expanding then makes k_nope's rounding residual too (one
#: more bf16 matmul, half the first) for the LSE's correction, absorbing almost nothing more
#: (340 at a 16k context). Measured as `CROSSOVER` (`--crossover --lse`, a busy neighbour): at
#: 16k, absorb / expand 0.91 at M = 256, 1.03 at 320, 1.20 at 384, and in a second run 0.89 at
#: 320, 1.04 at 384; at 1k, 0.84 at 160, 1.01 at 224 (the rule: 222); at 0, absorbing 1.8-3.2x
#: slower at M = 32..224
CROSSOVER_LSE = 352

#: the context (cached keys) at which "auto"'s crossover is half `CROSSOVER`: absorbing's causal
#: diagonal (a sequence a head, the keys repeated) and fixed costs weigh more on short contexts
ABSORB_CONTEXT_KNEE = 600

#: the same with fp32 products (fp32 or fp16 inputs, `precision="fp32"`, or a CPU without bf16
#: arithmetic), whatever the context: where the cost model's two figures (module docstring) meet
#: for DeepSeek's dims, 262,144 / (2,176 - 640) = 170.7
CROSSOVER_FP32 = 170

#: keys a block of the fp32 flash loop takes: the expand form makes k_nope and v for this many
#: at once
KEY_BLOCK = 256

#: fp32 scores of one block (queries x heads x keys); the query blocks are sized to it
SCORE_BUDGET_BYTES = 8 << 20

#: bf16 products: the bytes of one key block's k and v (bf16, all heads) the expand form makes
#: and hands the native kernel at once (which packs as many again): `NATIVE_BLOCK_BYTES_PER_QUERY`
#: a query of the sequence (a block's merge costs as much as its queries' out: more queries,
#: larger blocks), from `NATIVE_BLOCK_BYTES` to `NATIVE_BLOCK_MAX_BYTES`, a multiple of 256 keys.
#: Measured on an AMD EPYC Zen 5 (2 vCPUs, 16k context, 16 heads, paired): 8 MiB blocks were the
#: fastest from 16 to 256 new tokens (2 and 4 MiB no faster, 16 MiB 5-7 % slower at 16 and 64,
#: 32 MiB 15 %), 24-32 MiB from 1024 to 4096 (8 MiB 6-10 % slower at 1024 and 2048, 48 MiB 5 %)
NATIVE_BLOCK_BYTES = 8 << 20
NATIVE_BLOCK_BYTES_PER_QUERY = 16 << 10
NATIVE_BLOCK_MAX_BYTES = 32 << 20

#: bf16 products: the absorbed query rows (queries x heads) of one native kernel call
ABSORB_ROWS = 4096


@dataclass(frozen=True, slots=True)
class LatentBatch:
    """A validated varlen batch over the latent cache.

    q: `[Tq, H, Dqk]`; kv_c: `[Tk, R]`; k_pe: `[Tk, P]` with `P < Dqk`; w_kv_b:
    `[H * (Dn + Dv), R]` with `Dn = Dqk - P`, `Dv >= 1`, head h's rows `k_nope` then `v`; one dtype
    of bf16/fp16/fp32, on the CPU. `q_cu_seq_lens`/`kv_cu_seq_lens`: `B + 1` offsets as Python
    ints. `scale`: positive and finite.
    """

    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    w_kv_b: torch.Tensor
    q_cu_seq_lens: tuple[int, ...]
    kv_cu_seq_lens: tuple[int, ...]
    causal: bool
    scale: float

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[1])

    @property
    def kv_lora_rank(self) -> int:
        return int(self.kv_c.shape[1])

    @property
    def rope_dim(self) -> int:
        return int(self.k_pe.shape[1])

    @property
    def qk_nope_dim(self) -> int:
        return int(self.q.shape[2]) - self.rope_dim

    @property
    def v_head_dim(self) -> int:
        return int(self.w_kv_b.shape[0]) // self.num_heads - self.qk_nope_dim

    @property
    def num_seqs(self) -> int:
        """B, the batch's sequences."""
        return len(self.q_cu_seq_lens) - 1


def validate_latent(
    q: object,
    kv_c: object,
    k_pe: object,
    w_kv_b: object,
    q_cu_seq_lens: object,
    kv_cu_seq_lens: object | None,
    *,
    causal: bool,
    scale: float | None,
) -> LatentBatch:
    """Check every rule of `latent_attention`'s contract; raise `InvalidInputError` naming the
    first one broken."""
    q = check_tensor("q", q, "[Tq, H, Dqk]")
    kv_c = check_tensor("kv_c", kv_c, "[Tk, kv_lora_rank]")
    k_pe = check_tensor("k_pe", k_pe, "[Tk, rope_dim]")
    w_kv_b = check_tensor("w_kv_b", w_kv_b, "[H * (qk_nope_dim + v_head_dim), kv_lora_rank]")
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe), ("w_kv_b", w_kv_b)):
        if t.dtype != q.dtype:
            raise InvalidInputError(name, f"the dtype of q ({q.dtype})", str(t.dtype))
    tq, h, dqk = q.shape
    tk, rank = kv_c.shape
    if h < 1 or dqk < 1:
        raise InvalidInputError("q", "H >= 1 and Dqk >= 1", f"shape {tuple(q.shape)}")
    if rank < 1:
        raise InvalidInputError("kv_c", "kv_lora_rank >= 1", f"shape {tuple(kv_c.shape)}")
    if k_pe.shape[0] != tk:
        raise InvalidInputError(
            "k_pe", f"[Tk={tk}, rope_dim] (the tokens of kv_c)", f"shape {tuple(k_pe.shape)}"
        )
    rope = int(k_pe.shape[1])
    if rope >= dqk:
        raise InvalidInputError(
            "k_pe",
            f"rope_dim < Dqk = {dqk} (q is q_nope then q_pe)",
            f"rope_dim = {rope}",
        )
    nope = dqk - rope
    rows, w_rank = w_kv_b.shape
    if w_rank != rank:
        raise InvalidInputError(
            "w_kv_b",
            f"[H * (qk_nope_dim + v_head_dim), kv_lora_rank={rank}] (the rank of kv_c)",
            f"shape {tuple(w_kv_b.shape)}",
        )
    if rows % h or rows // h <= nope:
        raise InvalidInputError(
            "w_kv_b",
            f"H={h} heads of qk_nope_dim={nope} rows then v_head_dim >= 1 rows each "
            f"(a multiple of {h} over {h * nope})",
            f"{rows} rows",
            "kv_b_proj's weight is [out, in]: pass the Linear's weight, not its transpose",
        )
    q_cu, kv_cu = check_offsets(q_cu_seq_lens, kv_cu_seq_lens, tq, tk, keys="kv_c")
    return LatentBatch(q, kv_c, k_pe, w_kv_b, q_cu, kv_cu, bool(causal), check_scale(scale, dqk))


@overload
def latent_attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None = None,
    *,
    causal: bool = True,
    return_lse: Literal[False] = False,
    scale: float | None = None,
    form: Form = "auto",
    precision: Precision = "auto",
) -> torch.Tensor: ...
@overload
def latent_attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None = None,
    *,
    causal: bool = True,
    return_lse: Literal[True],
    scale: float | None = None,
    form: Form = "auto",
    precision: Precision = "auto",
) -> tuple[torch.Tensor, torch.Tensor]: ...
def latent_attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None = None,
    *,
    causal: bool = True,
    return_lse: bool = False,
    scale: float | None = None,
    form: Form = "auto",
    precision: Precision = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA attention over a ragged ("varlen") batch of `B` sequences, keys and values made from
    the latent cache: what `ragged_attention` computes on the expanded keys
    `k[t, h] = concat(kv_c[t] @ W_k[h].T, k_pe[t])` and values `v[t, h] = kv_c[t] @ W_v[h].T`,
    where `W_k[h]`, `W_v[h]` are rows `[h * (Dn + Dv), + Dn)` and `[h * (Dn + Dv) + Dn, + Dv)`
    of `w_kv_b`, without ever holding the context's expanded keys and values.

    Args:
        q: `[Tq, H, Dqk]`, bf16, fp16 or fp32: `q_nope` (Dn = Dqk - P) then `q_pe` (P).
        kv_c: `[Tk, R]`, q's dtype, the latent (R = kv_lora_rank, 512 in DeepSeek-V3).
        k_pe: `[Tk, P]`, q's dtype, the rope key every head shares (P = 64).
        w_kv_b: `[H * (Dn + Dv), R]`, q's dtype, `kv_b_proj`'s weight (a Linear's, out x in).
        q_cu_seq_lens: `[B + 1]` int32/int64 offsets into q, `0 = c[0] <= ... <= c[B] = Tq`.
        kv_cu_seq_lens: `[B + 1]` offsets into kv_c/k_pe; None means `q_cu_seq_lens`.
        causal: query i of a sequence sees keys `j <= i + Sk - Sq` (bottom-right aligned).
        return_lse: also return the softmax log-sum-exp.
        scale: score scale, default `Dqk ** -0.5`.
        form: "expand", "absorb", or "auto": per sequence, absorb where its new tokens Sq are
            fewer than `CROSSOVER`, less on a short context (bf16 products; `CROSSOVER_FP32`
            with fp32 ones), expand otherwise (a batch may use both).
        precision: "auto", bf16 products for bf16 inputs where `bf16_unavailable()` is None
            (the module's docstring: out within bf16's rounding, the LSE within ~1e-5 of fp64),
            fp32 products otherwise; "bf16", the same but the LSE as bf16's rounding of k_nope
            leaves it (within ~3e-3, as vLLM's expansion: an expanding call asked for its LSE
            costs 1.5x less at 2048 new tokens); or "fp32", fp32 products always.

    Returns:
        out `[Tq, H, Dv]` in q's dtype, or `(out, lse)` with lse `[H, Tq]` fp32 (natural log).
        Queries that see no key get `out = 0`, `lse = -inf`.

    Raises:
        InvalidInputError (a ValueError) naming the tensor or argument at fault.

    Memory beyond the inputs and results, fp32 products (all fp32): `w_kv_b`; one block of
    `KEY_BLOCK` keys (expand: their k_nope and v, H (Dn + Dv) floats a key; absorb: [kv_c, k_pe]);
    one block of scores (`SCORE_BUDGET_BYTES`); expand: q and the running softmax `[H, Sq, Dv]`
    of the whole sequence (so each key block is made once); absorb: one query block's
    `[H, rows, R + P]` queries and `[H, rows, R]` running output. About 26 MiB for a 16k
    context, 256 new tokens and DeepSeek-V3's 16 heads, expanding.

    bf16 products: expand, one key block's k and v (8 to 32 MiB: `NATIVE_BLOCK_BYTES`) and the
    kernel's packed copy (with the LSE, k_nope's residual beside v: Dn more value columns), and
    where there are several blocks, a block's out (bf16) and the running out `[Sq, H, Dv]`
    (`[Sq, H, Dv + Dn]` with the LSE; fp32); absorb, [kv_c, k_pe] (a view where they are one
    cache row, else a copy), the kernel's packed keys and values of the context, and per
    `ABSORB_ROWS` rows their folded queries, out and causal diagonal's keys. Measured at a 16k
    context and 16 heads (VmHWM growth, bench/latent.py, an EPYC Zen 5): 12 / 22 / 97 MiB
    expanding 64 / 256 / 2048 new tokens, 66 / 87 / 140 MiB absorbing them; auto with the LSE
    67 / 99 / 183 MiB. At 4096 new tokens, 173 MiB expanding, 284 MiB with the LSE corrected:
    the last, causal block holds all the new tokens' keys, their residual and fp32 running out.
    """
    if form not in FORMS:
        raise InvalidInputError("form", '"expand", "absorb" or "auto"', repr(form))
    if precision not in PRECISIONS:
        raise InvalidInputError("precision", '"auto", "bf16" or "fp32"', repr(precision))
    batch = validate_latent(
        q, kv_c, k_pe, w_kv_b, q_cu_seq_lens, kv_cu_seq_lens, causal=causal, scale=scale
    )
    out, lse = _attend(batch, form, precision, return_lse)
    return (out, lse) if return_lse else out


def bf16_unavailable() -> str | None:
    """Why `precision="auto"` keeps every product fp32 here, or None where it takes bf16 products
    on bf16 inputs: the CPU has bf16 arithmetic (AVX-512 BF16 or AMX; without it a bf16
    `torch.matmul` is a scalar loop) and zen-mla's native kernel passed its start-up probe and
    runs its AVX-512 BF16 path. Probed once per process."""
    return _bf16_unavailable()


@functools.cache
def _bf16_unavailable() -> str | None:
    cpu = cpu_facts()
    if not (cpu.avx512_bf16 or cpu.amx_bf16):
        return "this CPU has no bf16 arithmetic (AVX-512 BF16 or AMX): fp32 products"
    # imported here: the probes run the kernels through the driver, which the engine imports
    from .kernels.native import native_isa
    from .probes import host_facts

    failure = host_facts().native_failure
    if failure is not None:
        return failure
    if native_isa() != "avx512":
        return f"zen-mla's native kernel runs its {native_isa()} path here, not avx512"
    return None


def _attend(
    batch: LatentBatch, form: Form, precision: Precision, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    tq, h = batch.q.shape[:2]
    out = torch.empty(tq, h, batch.v_head_dim, dtype=batch.q.dtype)
    # written whether asked for or not: the log of the softmax's running sum, H x Tq floats
    lse = torch.empty(h, tq, dtype=torch.float32)
    nope, dv, rank = batch.qk_nope_dim, batch.v_head_dim, batch.kv_lora_rank
    bf16 = (
        precision != "fp32"
        and batch.q.dtype == torch.bfloat16
        and batch.q.shape[0] > 0
        and bf16_unavailable() is None
    )
    # bf16 products: the LSE's rounding move taken off where it is asked, "auto"
    exact_lse = return_lse and precision == "auto"
    weights = _Weights(batch.w_kv_b.reshape(h, nope + dv, rank))
    qc, kc = batch.q_cu_seq_lens, batch.kv_cu_seq_lens
    for r in range(batch.num_seqs):
        sq, sk = qc[r + 1] - qc[r], kc[r + 1] - kc[r]
        if sq == 0:
            continue
        # Queries that see no key (all of them without keys; the first Sq - Sk when causal)
        # are answered here; the rest are bottom-right aligned on their own (Sq' <= Sk).
        blind = sq if sk == 0 else (max(0, sq - sk) if batch.causal else 0)
        start = qc[r] + blind
        out[qc[r] : start].zero_()
        lse[:, qc[r] : start].fill_(float("-inf"))
        if blind == sq:
            continue
        keys = slice(kc[r], kc[r + 1])
        absorb = form == "absorb" or (
            form == "auto" and _absorbs(sq, sk, batch.causal, bf16, exact_lse)
        )
        rows = slice(start, qc[r + 1])
        if bf16:
            fast = _absorb_bf16 if absorb else _expand_bf16
            fast(
                batch.q[rows],
                batch.kv_c[keys],
                batch.k_pe[keys],
                weights.bf16,
                batch.causal,
                batch.scale,
                out[rows],
                lse[:, rows],
                exact_lse,
            )
        else:
            attend = _absorb if absorb else _expand
            attend(
                batch.q[rows],
                batch.kv_c[keys],
                batch.k_pe[keys],
                weights.fp32,
                batch.causal,
                batch.scale,
                out[rows],
                lse[:, rows],
            )
    return out, lse


def _absorbs(sq: int, sk: int, causal: bool, bf16: bool, exact_lse: bool) -> bool:
    """Whether "auto" absorbs a sequence of `sq` queries and `sk` keys: bf16 products, where
    `sq` (C + `ABSORB_CONTEXT_KNEE`) < `CROSSOVER` C (`CROSSOVER_LSE` C with the LSE corrected),
    C its cached keys (`sk - sq` causal, `sk` not); fp32 ones, where `sq < CROSSOVER_FP32`."""
    if not bf16:
        return sq < CROSSOVER_FP32
    context = max(0, sk - sq) if causal else sk
    crossover = CROSSOVER_LSE if exact_lse else CROSSOVER
    return sq * (context + ABSORB_CONTEXT_KNEE) < crossover * context


class _Weights:
    """`w_kv_b` as `[H, Dn + Dv, R]`, in fp32 (made once, where a sequence takes fp32 products)
    or as it is (bf16)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.bf16 = w
        self._fp32: torch.Tensor | None = None

    @property
    def fp32(self) -> torch.Tensor:
        if self._fp32 is None:
            self._fp32 = self.bf16.to(torch.float32)
        return self._fp32


def _query_rows(heads: int) -> int:
    """Queries of one block: `heads x rows x KEY_BLOCK` fp32 scores within the budget."""
    return max(1, SCORE_BUDGET_BYTES // (4 * heads * KEY_BLOCK))


def _hidden(a: int, b: int, k0: int, k1: int, off: int) -> torch.Tensor:
    """`[b - a, k1 - k0]` True where query i (of a, ..., b - 1) may not see key j (of k0, ...,
    k1 - 1): `j > i + off`."""
    return torch.arange(k0, k1)[None, :] > (torch.arange(a, b) + off)[:, None]


def _rescale(
    scores: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor, acc: torch.Tensor
) -> None:
    """One step of the online softmax: `scores [..., n]` become their weights under the new
    running max, and `row_max`, `row_sum` (`[...]`) and `acc` (`[..., D]`) are brought to it; the
    caller adds `scores @ values` to `acc`. A row may see no key of a later block, but every query
    a form takes sees key 0, in the first: no running max is -inf after it."""
    new_max = torch.maximum(row_max, scores.amax(-1))
    alpha = (row_max - new_max).exp_()
    scores.sub_(new_max.unsqueeze(-1)).exp_()
    row_sum.mul_(alpha).add_(scores.sum(-1))
    acc.mul_(alpha.unsqueeze(-1))
    row_max.copy_(new_max)


def _expand(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w: torch.Tensor,
    causal: bool,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """One sequence by the expand form: keys outer (each block made once), queries inner.

    q `[S, H, Dqk]`, kv_c `[Sk, R]`, k_pe `[Sk, P]`, w `[H, Dn + Dv, R]` fp32, out `[S, H, Dv]`,
    lse `[H, S]`; causal with `S <= Sk` (every query sees a key)."""
    s, h, dqk = q.shape
    sk, rank = kv_c.shape
    nope = dqk - k_pe.shape[1]
    dv = w.shape[1] - nope
    off = sk - s
    rows = _query_rows(h)
    starts = range(0, s, rows)
    # Heads first, the scale folded in, one contiguous tensor a query block, as is the block's
    # running state: torch runs a bmm into a strided slice as one matmul per head.
    qh = q.to(torch.float32).transpose(0, 1).mul(scale)
    q_blocks = [qh[:, a : a + rows].contiguous() for a in starts]
    del qh
    row_max = [torch.full(qb.shape[:2], float("-inf")) for qb in q_blocks]
    row_sum = [torch.zeros(qb.shape[:2]) for qb in q_blocks]
    acc = [torch.zeros(*qb.shape[:2], dv) for qb in q_blocks]
    w_rows = w.view(h * (nope + dv), rank)
    for k0 in range(0, sk, KEY_BLOCK):
        k1 = min(sk, k0 + KEY_BLOCK)
        # k_nope^T and v^T of the block for every head, one matmul: [H, Dn + Dv, n]
        kv = torch.mm(w_rows, kv_c[k0:k1].to(torch.float32).t()).view(h, nope + dv, k1 - k0)
        k_t = torch.empty(h, dqk, k1 - k0)
        k_t[:, :nope] = kv[:, :nope]
        k_t[:, nope:] = k_pe[k0:k1].t()  # every head's
        v = kv[:, nope:].transpose(1, 2)
        for j, a in enumerate(starts):
            b = min(s, a + rows)
            if causal and b - 1 + off < k0:  # no query of the block sees this key block
                continue
            scores = torch.bmm(q_blocks[j], k_t)
            if causal and k1 - 1 > a + off:
                scores.masked_fill_(_hidden(a, b, k0, k1, off), float("-inf"))
            _rescale(scores, row_max[j], row_sum[j], acc[j])
            acc[j].baddbmm_(scores, v)
    for j, a in enumerate(starts):
        b = min(s, a + rows)
        out[a:b] = acc[j].div_(row_sum[j].unsqueeze(-1)).transpose(0, 1)
        lse[:, a:b] = row_sum[j].log_().add_(row_max[j])


def _absorb(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w: torch.Tensor,
    causal: bool,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """One sequence by the absorb form: queries outer, keys inner; every head's queries against
    the one latent key block in one matmul. Shapes as `_expand`'s."""
    s, h, dqk = q.shape
    sk, rank = kv_c.shape
    rope = k_pe.shape[1]
    nope = dqk - rope
    w_k, w_v_t = w[:, :nope], w[:, nope:].transpose(1, 2)  # [H, Dn, R], [H, R, Dv]
    off = sk - s
    rows = _query_rows(h)
    for a in range(0, s, rows):
        b = min(s, a + rows)
        n_q = b - a
        qh = q[a:b].to(torch.float32).transpose(0, 1)  # [H, n_q, Dqk]
        # [q_nope W_k, q_pe] scaled: the query against the key [kv_c, k_pe]
        q_lat = torch.empty(h, n_q, rank + rope)
        q_lat[..., :rank] = torch.bmm(qh[..., :nope], w_k)
        q_lat[..., rank:] = qh[..., nope:]
        q_lat = q_lat.mul_(scale).view(h * n_q, rank + rope)
        del qh
        row_max = torch.full((h * n_q,), float("-inf"))
        row_sum = torch.zeros(h * n_q)
        o_lat = torch.zeros(h * n_q, rank)
        # keys past the block's last query's last visible one are never read
        end = min(sk, b + off) if causal else sk
        for k0 in range(0, end, KEY_BLOCK):
            k1 = min(end, k0 + KEY_BLOCK)
            key = torch.empty(k1 - k0, rank + rope)
            key[:, :rank] = kv_c[k0:k1]
            key[:, rank:] = k_pe[k0:k1]
            scores = torch.mm(q_lat, key.t())
            if causal and k1 - 1 > a + off:
                hidden = _hidden(a, b, k0, k1, off)
                scores.view(h, n_q, k1 - k0).masked_fill_(hidden, float("-inf"))
            _rescale(scores, row_max, row_sum, o_lat)
            o_lat.addmm_(scores, key[:, :rank])
        o_lat.div_(row_sum.unsqueeze(-1))
        out[a:b] = torch.bmm(o_lat.view(h, n_q, rank), w_v_t).transpose(0, 1)
        lse[:, a:b] = row_sum.log_().add_(row_max).view(h, n_q)


def _native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu: list[int],
    kv_cu: list[int],
    scale: float,
    causal: bool,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """zen-mla's native kernel on its AVX-512 BF16 path (`bf16_unavailable()` is None): out
    `[Tq, H, Dv]` bf16 and lse `[H, Tq]` written (any strides), bottom-right causal, queries
    that see no key 0 and -inf."""
    from .kernels.native import blocks

    torch.ops.zen_mla.native_attend(
        q,
        k,
        v,
        torch.tensor(q_cu, dtype=torch.int64),
        torch.tensor(kv_cu, dtype=torch.int64),
        scale,
        causal,
        out,
        lse,
        *blocks(),
        0,  # K and V packed for all heads at once: a block's, as many bytes as k and v
        None,
        "avx512",
    )


def _merge_into(acc: torch.Tensor, m: torch.Tensor, o: torch.Tensor, o_lse: torch.Tensor) -> None:
    """`merge.merge_attn_states` in place and in fp32, a part at a time: `acc` `[S, H, D]` fp32
    and its LSE `m` `[H, S]` (finite: every query saw a key of an earlier part) take the part
    `o` `[S, H, D]`, `o_lse` `[H, S]` (-inf, and o 0, where a query saw none of its keys)."""
    new = torch.logaddexp(m, o_lse)
    mine = (m - new).exp_().t().unsqueeze(-1)
    theirs = (o_lse - new).exp_().t().unsqueeze(-1)
    acc.mul_(mine).addcmul_(o, theirs)
    m.copy_(new)


def _key_edges(sk: int, s: int, step: int, causal: bool) -> list[int]:
    """Key blocks `[e[i], e[i + 1])` of about `step` keys, even, covering `[0, sk)`; causal, the
    last holds every key past the first query's last (`off = sk - s`), which it alone attends
    causally (bottom-right within the block is bottom-right within the sequence); the others
    every query sees whole."""
    n = -(-sk // step)
    edges = [sk * i // n for i in range(n + 1)]
    if causal and len(edges) > 2 and edges[-2] > sk - s + 1:
        head = sk - s + 1  # keys 0..off, seen by every query
        m = -(-head // step)
        edges = [head * i // m for i in range(m + 1)] + [sk]
    return edges


def _native_block(queries: int, heads: int, dqk: int, dv: int) -> int:
    """Keys of one bf16 expand block for `queries` queries (`NATIVE_BLOCK_BYTES`), a multiple of
    256 keys (the kernel's key blocks) where that is 256 or more, at least 1."""
    budget = min(
        NATIVE_BLOCK_MAX_BYTES, max(NATIVE_BLOCK_BYTES, queries * NATIVE_BLOCK_BYTES_PER_QUERY)
    )
    keys = budget // (heads * (dqk + dv) * 2)
    return keys // 256 * 256 if keys >= 256 else max(1, keys)


def _expand_bf16(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w: torch.Tensor,
    causal: bool,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    exact_lse: bool = True,
) -> None:
    """One sequence by the expand form in bf16 products: per key block, k = [k_nope, k_pe] and
    v of every head made from the latent in one bf16 matmul (fp32 sums, rounded to bf16 as
    vLLM's expansion rounds them), then the native kernel over all the sequence's queries and
    that block, with its LSE; the blocks' results merged by their LSEs in fp32.

    `exact_lse`: k_nope's rounding moves a score by `scale q_nope . dk` (dk = k_nope - bf16(k_nope),
    ~2^-9 of k_nope) and the LSE by the scores' moves weighted by the softmax, to first order:
    dk (one more bf16 matmul, its fp32 sums less the rounded k_nope, rounded) rides beside v as
    Dn more value columns, and `scale q_nope . (softmax-weighted dk)` is added to the LSE
    (what is left, half the moves' variance under the softmax, ~1e-6). Without, the LSE is the
    rounded keys' (out is the same either way).

    q `[S, H, Dqk]`, kv_c `[Sk, R]`, k_pe `[Sk, P]`, w `[H, Dn + Dv, R]` bf16, out
    `[S, H, Dv]`, lse `[H, S]`; causal with `S <= Sk` (every query sees a key)."""
    s, h, dqk = q.shape
    sk, rank = kv_c.shape
    nope = dqk - k_pe.shape[1]
    dv = w.shape[1] - nope
    exact_lse = exact_lse and nope > 0
    w_t = w.reshape(h * (nope + dv), rank).t()
    # W_k's rows of every head, one matrix (the residual's)
    w_k_t = w[:, :nope].reshape(h * nope, rank).t() if exact_lse else w_t
    width = dv + nope if exact_lse else dv  # the kernel's value columns
    # the blocks of k and v alone (dk not counted): out the same with the LSE or without
    edges = _key_edges(sk, s, _native_block(s, h, dqk, dv), causal)
    direct = len(edges) == 2 and not exact_lse  # one block: straight into the results
    acc = m = part = part_lse = None
    for k0, k1 in itertools.pairwise(edges):
        n = k1 - k0
        x = kv_c[k0:k1]
        kv = torch.mm(x, w_t).view(n, h, nope + dv)
        k = torch.empty(n, h, dqk, dtype=q.dtype)
        k[..., :nope] = kv[..., :nope]
        k[..., nope:] = k_pe[k0:k1, None]
        if exact_lse:
            # x W_k^T - bf16(x W_k^T), the subtraction within the matmul's fp32 sums
            rounded = kv[..., :nope].reshape(n, h * nope)
            dk = torch.addmm(rounded, x, w_k_t, beta=-1).view(n, h, nope)
            v = torch.empty(n, h, width, dtype=q.dtype)
            v[..., :dv] = kv[..., nope:]
            v[..., dv:] = dk
            del rounded, dk
            kv = kv[:0]  # k and v are copies: the block's matmul freed before the kernel
        else:
            v = kv[..., nope:]
        block_causal = causal and k1 - 1 > sk - s
        if direct:
            _native(q, k, v, [0, s], [0, n], scale, block_causal, out, lse)
            return
        if part is None or part_lse is None:
            part = torch.empty(s, h, width, dtype=q.dtype)
            part_lse = torch.empty(h, s, dtype=torch.float32)
        _native(q, k, v, [0, s], [0, n], scale, block_causal, part, part_lse)
        del kv, k, v
        if len(edges) == 2:
            acc, m = part, part_lse
        elif acc is None or m is None:
            acc, m = part.to(torch.float32), part_lse.clone()
        else:
            _merge_into(acc, m, part, part_lse)
    assert acc is not None and m is not None
    del part
    out.copy_(acc[..., :dv])
    if exact_lse:
        for a in range(0, s, 256):  # a few MiB of fp32 at a time
            rows = slice(a, a + 256)
            shift = torch.einsum(
                "shd,shd->hs", q[rows, :, :nope].float(), acc[rows, :, dv:].float()
            )
            m[:, rows] += scale * shift
    lse.copy_(m)


def _latent_key(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """`[Sk, R + P]`, `[kv_c, k_pe]` a row, unit last stride: a view where the two are one row
    of vLLM's MLA cache already, else a copy."""
    sk, rank = kv_c.shape
    if (
        kv_c.stride(1) == 1
        and (k_pe.stride(1) == 1 or k_pe.shape[1] <= 1)
        and (kv_c.stride(0) == k_pe.stride(0) or sk <= 1)
        and k_pe.data_ptr() == kv_c.data_ptr() + rank * kv_c.element_size()
        and k_pe.untyped_storage().data_ptr() == kv_c.untyped_storage().data_ptr()
    ):
        return kv_c.as_strided((sk, rank + k_pe.shape[1]), (kv_c.stride(0), 1))
    return torch.cat([kv_c, k_pe], dim=1)


def _absorb_bf16(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w: torch.Tensor,
    causal: bool,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    exact_lse: bool = True,
) -> None:
    """One sequence by the absorb form in bf16 products: the queries of every head folded
    (`[q_nope W_k, q_pe]`, one bf16 bmm, rounded to bf16) and taken as the rows of a one-head
    problem against the latent key `[kv_c, k_pe]`, values `kv_c`, in the native kernel:
    `ABSORB_ROWS` rows a call, the keys every row of the block sees at once, and causal, the
    block's own diagonal as one sequence a head against its keys repeated; parts merged by
    their LSEs in fp32, then unfolded through W_v (one bf16 bmm). Shapes as `_expand_bf16`'s.

    `exact_lse`: the folded query's rounding dq (one more bf16 bmm, its fp32 sums less the
    rounded query) moves a score by `scale dq . kv_c`, the LSE by `scale dq . o_lat` (o_lat the
    kernel's out, the softmax-weighted kv_c) to first order, which is added to it: as
    `_expand_bf16`'s, at the cost of a dot product a row."""
    s, h, dqk = q.shape
    sk, rank = kv_c.shape
    rope = k_pe.shape[1]
    nope = dqk - rope
    width = rank + rope
    key = _latent_key(kv_c, k_pe)
    # [H, Dn, R] and [H, Dv, R], views: bmm copies a transposed weight on every call
    w_k, w_v = w[:, :nope], w[:, nope:]
    off = sk - s
    rows = max(1, ABSORB_ROWS // h)
    for a in range(0, s, rows):
        b = min(s, a + rows)
        n = b - a
        q_nope = q[a:b, :, :nope].transpose(0, 1)
        folded = torch.bmm(q_nope, w_k)
        q_lat = torch.empty(h, n, width, dtype=q.dtype)
        q_lat[..., :rank] = folded
        q_lat[..., rank:] = q[a:b, :, nope:].transpose(0, 1)
        # q_nope W_k - bf16(q_nope W_k), the subtraction within the bmm's fp32 sums
        dq = torch.baddbmm(folded, q_nope, w_k, beta=-1) if exact_lse and nope else None
        del folded
        q_rows = q_lat.view(h * n, 1, width)
        # keys [0, c): every query of the block sees them all
        c = a + off + 1 if causal else sk
        o = torch.empty(h * n, 1, rank, dtype=q.dtype)
        o_lse = torch.empty(1, h * n, dtype=torch.float32)
        _native(
            q_rows, key[:c, None], key[:c, None, :rank], [0, h * n], [0, c], scale, False, o, o_lse
        )
        if causal and n > 1:
            # keys [c, b + off), n - 1 of them: head j's rows a sequence against its own copy,
            # bottom-right causal (row i sees the tail's first i keys)
            t = n - 1
            tail = key[c : b + off].unsqueeze(0).expand(h, t, width).reshape(h * t, 1, width)
            o2 = torch.empty(h * n, 1, rank, dtype=q.dtype)
            o2_lse = torch.empty(1, h * n, dtype=torch.float32)
            cu_q, cu_k = [j * n for j in range(h + 1)], [j * t for j in range(h + 1)]
            _native(q_rows, tail, tail[..., :rank], cu_q, cu_k, scale, True, o2, o2_lse)
            del tail
            acc = o.to(torch.float32)
            _merge_into(acc, o_lse, o2, o2_lse)
            o = acc.to(q.dtype)
        if dq is not None:
            shift = torch.einsum("hnr,hnr->hn", dq.float(), o.view(h, n, rank).float())
            o_lse = o_lse.view(h, n).add(shift, alpha=scale)
        # out^T = W_v o^T a head: the block's o transposed (H n R), not the weight (H R Dv)
        o_t = o.view(h, n, rank).transpose(1, 2).contiguous()
        out[a:b] = torch.bmm(w_v, o_t).permute(2, 0, 1)
        lse[:, a:b] = o_lse.view(h, n)
