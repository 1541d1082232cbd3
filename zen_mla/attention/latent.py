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
from dataclasses import dataclass
from typing import Literal, overload

import torch

from ..errors import InvalidInputError
from . import latent_bf16, latent_fp32
from .batch import check_offsets, check_scale, check_tensor, visible_pairs
from .host import cpu_facts

__all__ = [
    "ABSORB_CONTEXT_KNEE",
    "CROSSOVER",
    "CROSSOVER_FP32",
    "CROSSOVER_LSE",
    "FORMS",
    "PRECISIONS",
    "Form",
    "LatentBatch",
    "Precision",
    "absorbs",
    "bf16_products",
    "bf16_unavailable",
    "latent_attention",
    "validate_latent",
    "work",
    "workspace_bytes",
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
    `latent_fp32.KEY_BLOCK` keys (expand: their k_nope and v, H (Dn + Dv) floats a key;
    absorb: [kv_c, k_pe]); one block of scores (`latent_fp32.SCORE_BUDGET_BYTES`); expand: q
    and the running softmax `[H, Sq, Dv]` of the whole sequence (so each key block is made
    once); absorb: one query block's `[H, rows, R + P]` queries and `[H, rows, R]` running
    output. About 26 MiB for a 16k context, 256 new tokens and DeepSeek-V3's 16 heads,
    expanding.

    bf16 products: expand, one key block's k and v (8 to 32 MiB:
    `latent_bf16.NATIVE_BLOCK_BYTES`) and the kernel's packed copy (with the LSE, k_nope's
    residual beside v: Dn more value columns), and where there are several blocks, a block's
    out (bf16) and the running out `[Sq, H, Dv]` (`[Sq, H, Dv + Dn]` with the LSE; fp32);
    absorb, [kv_c, k_pe] (a view where they are one cache row, else a copy), the kernel's packed
    keys and values of the context, and per `latent_bf16.ABSORB_ROWS` rows their folded
    queries, out and causal diagonal's keys. Measured at a 16k context and 16 heads (VmHWM
    growth, bench/latent.py, an EPYC Zen 5): 12 / 22 / 97 MiB expanding 64 / 256 / 2048 new
    tokens, 66 / 87 / 140 MiB absorbing them; auto with the LSE 67 / 99 / 183 MiB. At 4096 new
    tokens, 173 MiB expanding, 284 MiB with the LSE corrected:
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


def bf16_products(batch: LatentBatch, precision: Precision) -> bool:
    """Whether `batch` is computed with bf16 products (the module's docstring)."""
    return (
        precision != "fp32"
        and batch.q.dtype == torch.bfloat16
        and batch.q.shape[0] > 0
        and bf16_unavailable() is None
    )


def work(batch: LatentBatch, form: Form, *, precision: Precision, return_lse: bool) -> int:
    """Multiply-adds of a batch's products (the module docstring's cost model), each sequence in
    the form `form` takes for it: expand, `R (Dn + Dv)` a head and key to make k and v, then
    `Dqk + Dv` a head and visible pair; absorb, `(R + P) + R` a head and visible pair, and
    `R (Dn + Dv)` a head and query to fold the weight into q and out."""
    h, rank, rope = batch.num_heads, batch.kv_lora_rank, batch.rope_dim
    nope, dv = batch.qk_nope_dim, batch.v_head_dim
    bf16 = bf16_products(batch, precision)
    exact_lse = return_lse and precision == "auto"
    qc, kc = batch.q_cu_seq_lens, batch.kv_cu_seq_lens
    total = 0
    for r in range(batch.num_seqs):
        sq, sk = qc[r + 1] - qc[r], kc[r + 1] - kc[r]
        pairs = visible_pairs(sq, sk, batch.causal)
        if form == "absorb" or (form == "auto" and absorbs(sq, sk, batch.causal, bf16, exact_lse)):
            total += h * ((2 * rank + rope) * pairs + rank * (nope + dv) * sq)
        elif sq:
            total += h * (rank * (nope + dv) * sk + (nope + rope + dv) * pairs)
    return total


def workspace_bytes(batch: LatentBatch, *, threads: int) -> int:
    """An upper bound of what `latent_attention` allocates beyond its inputs and results, on a
    worker of `threads`, in either form and precision (the docstring of `latent_attention`
    lists what each holds): the weight in fp32, a key block made from the latent with its
    packed copy and residual, the longest sequence's queries and running outputs, the latent
    key's copy and packed form, and a block of scores a thread."""
    h, rank, rope = batch.num_heads, batch.kv_lora_rank, batch.rope_dim
    nope, dv = batch.qk_nope_dim, batch.v_head_dim
    qc, kc = batch.q_cu_seq_lens, batch.kv_cu_seq_lens
    spans = range(batch.num_seqs)
    longest = max((qc[r + 1] - qc[r] for r in spans), default=0)
    keys = max((kc[r + 1] - kc[r] for r in spans), default=0)
    weight = 4 * h * (nope + dv) * rank
    # a key block is at most the sequence's keys (bf16 k, v and k_nope's residual, all heads)
    block = min(latent_bf16.NATIVE_BLOCK_MAX_BYTES, 2 * keys * h * (2 * nope + rope + dv))
    fp32_block = 4 * min(latent_fp32.KEY_BLOCK, keys) * (h * (nope + dv) + rank + rope)
    queries = 4 * longest * h * (2 * (rank + rope) + 2 * (nope + dv))
    latent_key = 3 * 2 * keys * (rank + rope)
    absorbed = 4 * min(latent_bf16.ABSORB_ROWS, longest * h) * (2 * rank + rope)
    scores = min(latent_fp32.SCORE_BUDGET_BYTES, 4 * longest * h * latent_fp32.KEY_BLOCK)
    blocks = max(3 * block, fp32_block)
    return weight + blocks + queries + latent_key + absorbed + scores * max(threads, 1)


def _attend(
    batch: LatentBatch, form: Form, precision: Precision, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    tq, h = batch.q.shape[:2]
    out = torch.empty(tq, h, batch.v_head_dim, dtype=batch.q.dtype)
    # written whether asked for or not: the log of the softmax's running sum, H x Tq floats
    lse = torch.empty(h, tq, dtype=torch.float32)
    nope, dv, rank = batch.qk_nope_dim, batch.v_head_dim, batch.kv_lora_rank
    bf16 = bf16_products(batch, precision)
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
            form == "auto" and absorbs(sq, sk, batch.causal, bf16, exact_lse)
        )
        rows = slice(start, qc[r + 1])
        if bf16:
            fast = latent_bf16.absorb if absorb else latent_bf16.expand
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
            attend = latent_fp32.absorb if absorb else latent_fp32.expand
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


def absorbs(sq: int, sk: int, causal: bool, bf16: bool, exact_lse: bool) -> bool:
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
