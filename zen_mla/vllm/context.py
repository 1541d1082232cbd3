"""One prefill step with cached context sent at once: `ContextKV` and `prefill_with_context`,
and the checks every answer of the service passes before it is returned as numbers."""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from ..attention import PrefillOutput
from ..attention.batch import check_out
from ..attention.merge import merge_many
from ..errors import KernelError
from ..wire import PrefillOptions
from .settings import DEFAULT_CONCURRENCY

__all__ = [
    "CheckedPrefiller",
    "ContextKV",
    "PrefillOutput",
    "Prefiller",
    "RaggedTensors",
    "call",
    "check_finite",
    "check_out",
    "check_result",
    "inline",
    "lse_of",
    "pool",
    "prefill_with_context",
]

#: q, k, v, q_cu_seq_lens, kv_cu_seq_lens (None: q's)
RaggedTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


class Prefiller(Protocol):
    """What computes a piece: a `zen_mla.client.PrefillClient`, or the backend's link to the
    service (which computes locally while the service is down)."""

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_cu_seq_lens: torch.Tensor,
        kv_cu_seq_lens: torch.Tensor | None = None,
        *,
        causal: bool = True,
        return_lse: bool = False,
        scale: float | None = None,
        out: torch.Tensor | None = None,
    ) -> PrefillOutput: ...


class CheckedPrefiller:
    """A `Prefiller` that checks what it returns itself (the link: the service's answers pass
    `call` there, and what it computes while the service is down is `ragged_attention`'s), so
    that `call` does not check them a second time."""


class _Pools:
    """The thread pools that send a step's pieces, one per size, shared per process.

    `_lock` guards `_pools`."""

    _lock = threading.Lock()
    _pools: ClassVar[dict[int, ThreadPoolExecutor]] = {}

    @classmethod
    def get(cls, max_concurrency: int) -> ThreadPoolExecutor:
        with cls._lock:
            if max_concurrency not in cls._pools:
                cls._pools[max_concurrency] = ThreadPoolExecutor(
                    max_concurrency, thread_name_prefix="zen-mla-prefill"
                )
            return cls._pools[max_concurrency]


def pool(max_concurrency: int) -> ThreadPoolExecutor:
    """The process's thread pool of that size."""
    return _Pools.get(max_concurrency)


class _Inline(Executor):
    """Runs each piece on the submitting thread, there and then: pieces computed in this process
    each take all its cores, so running two at once would only make them fight."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        future: Future[object] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller by result(), as a pool would
            future.set_exception(exc)
        return future


def inline() -> Executor:
    """An executor that runs each piece on the caller's thread, one after another."""
    return _Inline()


@dataclass(frozen=True, slots=True)
class ContextKV:
    """The keys and values of one context chunk, for every request of a step.

    `k`: `[Tk, H, Dqk]`, `v`: `[Tk, H, Dv]` (q's dtype); `cu_seq_lens`: `[B + 1]` int32/int64
    offsets of each request's keys in this chunk (a request may have none).
    """

    k: torch.Tensor
    v: torch.Tensor
    cu_seq_lens: torch.Tensor


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def check_result(
    out: torch.Tensor, lse: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor
) -> None:
    """The edge to the network: a reply of the wrong shape or dtype is an error, never numbers."""
    t, h, dv = q.shape[0], q.shape[1], v.shape[-1]
    if tuple(out.shape) != (t, h, dv) or out.dtype != v.dtype:
        want = f"{[t, h, dv]} {str(v.dtype).removeprefix('torch.')} (v's dtype)"
        raise KernelError(f"the service sent out {_describe(out)}, expected {want}")
    if lse is not None and (tuple(lse.shape) != (h, t) or lse.dtype != torch.float32):
        raise KernelError(f"the service sent lse {_describe(lse)}, expected {[h, t]} float32")


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite, in one pass where it is: a sum carries NaN and inf
    through and is the cheapest pass over `t` (`torch.isfinite(t).all()` measured 5-15x slower
    on a Zen 4 CPU); a sum that overflowed from finite values (fp16) is settled by the smallest
    and largest value, which carry NaN too."""
    if bool(torch.isfinite(t.sum())):
        return True
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def _lse_answer(lse: torch.Tensor) -> bool:
    """Whether no value of `lse` is NaN or +inf (-inf is an answer: a query that sees no key;
    max carries NaN, and NaN < inf is False)."""
    return lse.numel() == 0 or bool(lse.max() < math.inf)


def _bad_rows(t: torch.Tensor) -> torch.Tensor:
    """`[T]` bool: which rows of `t` (`[T, ...]`) hold NaN or inf. A row's sum carries them, in
    t's dtype (one pass, no copy of a strided `t`; on bf16 a sum into float32 measured 6-8x
    slower, on a Xeon with AMX); rows whose sum is not finite are settled value by value (a sum
    of large finite values may overflow: fp16's past 65504), `isfinite` being 20x a sum's cost
    there."""
    bad = ~torch.isfinite(t.sum(dim=tuple(range(1, t.ndim))))
    rows = bad.nonzero().flatten()
    if rows.numel():
        bad[rows] = ~torch.isfinite(t[rows].reshape(rows.numel(), -1)).all(dim=1)
    return bad


def _requests_with(rows: torch.Tensor, cu_seq_lens: torch.Tensor) -> torch.Tensor:
    """`[B]` bool: which requests (rows `cu_seq_lens[r]:cu_seq_lens[r + 1]`) hold a row
    flagged in `rows` (`[T]` bool)."""
    counts = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(rows, 0, out=counts[1:])
    return counts[cu_seq_lens[1:]] > counts[cu_seq_lens[:-1]]


def _rows_of(requests: torch.Tensor, cu_seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """`[n]` bool: which rows lie in a request flagged in `requests` (`[B]` bool)."""
    positions = torch.arange(n, device=requests.device)
    of = torch.bucketize(positions, cu_seq_lens[1:], right=True)  # past the last request: B
    return torch.cat([requests, requests.new_zeros(1)])[of]


def _not_finite(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor,
) -> tuple[str, int, int, list[int]] | None:
    """The first output holding NaN or inf (an lse's -inf is an answer) in a request whose q,
    k and v are finite, as (name, how many such values in such requests, of how many values,
    those requests); None when no output does. One pass over each output where both are finite;
    else one more over each output, and the inputs of only the requests whose outputs are not
    finite are read."""
    if _finite(out) and (lse is None or _lse_answer(lse)):
        return None
    t_q, device = out.shape[0], out.device
    q, k, v = inputs
    # the offsets of a request the service answered: within [0, T], and trusted no further
    q_cu = q_cu_seq_lens.to(device=device, dtype=torch.int64).clamp(0, t_q)
    kv_cu = kv_cu_seq_lens.to(device=device, dtype=torch.int64).clamp(0, k.shape[0])
    outputs = [("out", out, _requests_with(_bad_rows(out), q_cu))]
    if lse is not None:
        outputs.append(("lse", lse, _requests_with(~(lse < math.inf).all(dim=0), q_cu)))
    suspects = torch.stack([bad for _, _, bad in outputs]).any(dim=0)
    qc, kc = q_cu.tolist(), kv_cu.tolist()
    for r in suspects.nonzero().flatten().tolist():
        fed = (q[qc[r] : qc[r + 1]], k[kc[r] : kc[r + 1]], v[kc[r] : kc[r + 1]])
        if not all(_finite(t) for t in fed):
            suspects[r] = False  # NaN in gives NaN out: no fault of the service's
    for name, t, bad in outputs:
        faulty = bad & suspects
        if bool(faulty.any()):
            rows = _rows_of(faulty, q_cu, t_q)
            wrong = ~torch.isfinite(t[rows]) if name == "out" else ~(t[:, rows] < math.inf)
            return name, int(wrong.sum()), t.numel(), faulty.nonzero().flatten().tolist()
    return None


def check_finite(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None = None,
) -> None:
    """A reply of NaN or inf for a request whose q, k and v are finite is an error, never
    numbers; request by request (`q_cu_seq_lens`, `kv_cu_seq_lens`: `[B + 1]` offsets, kv's
    absent: q's), so that NaN in one request's inputs (NaN in gives NaN out: no fault of the
    service's) lets no NaN through in another's outputs. About one pass over each output; the
    inputs are read only when an output is not finite. Zeros of the right shape pass: they
    cannot be told from an answer cheaply."""
    kv_cu = q_cu_seq_lens if kv_cu_seq_lens is None else kv_cu_seq_lens
    found = _not_finite(out, lse, (q, k, v), q_cu_seq_lens, kv_cu)
    if found is None:
        return
    name, bad, total, requests = found
    which = ", ".join(map(str, requests[:8])) + (", ..." if len(requests) > 8 else "")
    raise KernelError(
        f"the service sent {name} with {bad} of {total} values NaN or inf, expected finite "
        f"numbers from finite q, k and v (in request {which} of {q_cu_seq_lens.numel() - 1})"
    )


def call(
    client: Prefiller,
    tensors: RaggedTensors,
    options: PrefillOptions,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One piece, `(q, k, v, q_cu_seq_lens, kv_cu_seq_lens)`, through `client`, its answer
    checked (`check_result`, `check_finite`; by the client itself where it is a
    `CheckedPrefiller`); lse is None unless `options.return_lse`. `out`, where given (checked by
    `check_out`), is written in place and returned."""
    q, k, v, q_cu, kv_cu = tensors
    got = client.prefill(
        q,
        k,
        v,
        q_cu,
        kv_cu,
        causal=options.causal,
        return_lse=options.return_lse,
        scale=options.scale,
        out=out,
    )
    out, lse = got if isinstance(got, tuple) else (got, None)
    if options.return_lse and lse is None:
        raise KernelError("the service sent no lse where one was asked for")
    if not isinstance(client, CheckedPrefiller):
        check_result(out, lse, q, v)
        check_finite(out, lse, q, k, v, q_cu, kv_cu)
    return out, lse


def prefill_with_context(
    client: Prefiller,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    context: Sequence[ContextKV],
    *,
    scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    executor: Executor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One prefill step with cached context: new tokens and every context chunk sent to the
    service at once, merged by LSE.

    Equals bottom-right causal attention of each request's new tokens over its context (the
    chunks' keys, in any order) followed by its new tokens.

    Args:
        client: what computes each piece: a `PrefillClient` (several endpoints spread
            the pieces) or a backend's link to the service.
        q: `[T, H, Dqk]` new tokens' queries; k `[T, H, Dqk]`, v `[T, H, Dv]` their keys and
            values (bf16, fp16 or fp32, one dtype).
        query_start_loc: `[B + 1]` int32/int64 offsets of each request's new tokens.
        context: the step's context chunks; empty means no request has context.
        scale: score scale, default `Dqk ** -0.5`.
        return_lse: also return the merged LSE, `[H, T]` fp32, natural log.
        out: `[T, H, Dv]` in v's dtype to write into; default a new tensor.
        executor: runs the requests; default a pool of `DEFAULT_CONCURRENCY` threads
            shared per process.

    Returns:
        out `[T, H, Dv]` (v's dtype, q's device), or `(out, lse)`.

    Raises:
        the `zen_mla` exception the service or the client raised for any piece (after every
        piece has finished: no request is left running behind the caller's back).
    """
    if out is not None:
        check_out(out, q, v)
    if not context:
        new_out, new_lse = call(
            client,
            (q, k, v, query_start_loc, None),
            PrefillOptions(causal=True, return_lse=return_lse, scale=scale),
            out,
        )
        return (new_out, lse_of(new_lse)) if return_lse else new_out

    runner = executor if executor is not None else pool(DEFAULT_CONCURRENCY)
    new = PrefillOptions(causal=True, return_lse=True, scale=scale)
    chunk = PrefillOptions(causal=False, return_lse=True, scale=scale)
    pieces = [runner.submit(call, client, (q, k, v, query_start_loc, None), new)]
    pieces += [
        runner.submit(call, client, (q, c.k, c.v, query_start_loc, c.cu_seq_lens), chunk)
        for c in context
    ]
    concurrent.futures.wait(pieces)
    results = [p.result() for p in pieces]  # raises the first piece's error, in order
    merged, merged_lse = merge_many(
        [o for o, _ in results], [lse_of(x) for _, x in results], output=out
    )
    return (merged, merged_lse) if return_lse else merged


def lse_of(lse: torch.Tensor | None) -> torch.Tensor:
    if lse is None:
        raise KernelError("the service sent no lse where one was asked for")
    return lse
