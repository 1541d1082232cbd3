"""Many clients on every route of one real server at once (tests/service/test_many_clients.py):
the calls they make, each answer checked against the library's on the same tensors, and a
tally by route of what came back.

Routes, each a kind of caller:

- `socket`: `PrefillClient(shared_memory=True)`, one per thread: every call on the region
  socket, no HTTP on its way.
- `regions_http`: a regions JSON `/prefill` over HTTP (httpx), its tensors laid out in regions
  of its own connection to the region socket (`RegionSet.request`).
- `safetensors`: `PrefillClient(shared_memory=False)`: a safetensors body both ways; answers of
  2 MiB among them (read straight from the socket, computed on the pool's queued path).
- `v2`: `/v2/models/mla_prefill/infer` with the binary tensor data extension (tritonclient).
- `async`: tasks on one `AsyncPrefillClient()` in one event-loop thread: automatic, so a call
  takes the region socket, or regions JSON over HTTP while the other task holds the socket.
- `latent_socket`, `latent_http`: `PrefillClient(shared_memory=True / False).prefill_latent`
  over MLA's latent cache, each case's queries over a latent context of its keys' length: on
  the region socket (the weight registered there from a region) or a safetensors body (the
  weight uploaded).

Every caller cycles through `CASE_SPECS`, three small calls to one large (an answer over 1 MiB,
which the service queues for the pool's dispatcher threads, where a small call is lent an idle
worker from the event loop): both ways to a worker at once, the mix that once claimed a worker
twice. After the load, `then_each_path` asks each path once more, one call at a time.

A call is right when it equals `zen_mla.ragged_attention` on the same tensors bit for bit (the
service runs the same kernel; tests/service/routes/test_prefill.py asks the same); a wrong one says
which tokens and heads differ, and whether it is within the fp64 reference's tolerance all the
same. A latent call is right within a rounding of bf16 of in-process `latent_attention` (the
workers run it on heads apart: its matmuls block differently). A 429 is retried after its
Retry-After, at most `RETRIES` times, by every caller (the library clients do it themselves):
only a call that fails in the end counts as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import torch

import zen_mla
from tests.batches import BatchSpec, make_batch
from tests.reference import assert_close_to_reference
from tests.service.servers import Server
from tests.service.v2_tensors import to_numpy, to_torch
from zen_mla.client import AsyncPrefillClient, PrefillClient
from zen_mla.errors import BY_STATUS, DeadlineExceededError, QueueFullError, ZenMLAError
from zen_mla.regions.connection import RegionConnection, RegionSet
from zen_mla.wire import options_metadata
from zen_mla.wire import regions_json as rr

MLA = (4, 192, 128)  # H, Dqk, Dv: 2048 tokens give a 2 MiB `out`
RETRIES = 3  # 429s retried per call, as the library clients' default


# -- the calls ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One prefill call: its batch, options, and the library's answer on the same tensors."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_cu: torch.Tensor
    kv_cu: torch.Tensor | None
    causal: bool
    return_lse: bool
    want: tuple[torch.Tensor, ...]  # (out,) or (out, lse)

    @property
    def large(self) -> bool:
        """Its answer is over 1 MiB: the service queues it for the pool's dispatcher threads
        (service/body.py's SMALL_BYTES), where a small one goes straight to an idle worker."""
        return self.want[0].nbytes > 1 << 20

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"q": self.q, "k": self.k, "v": self.v, "q_cu_seq_lens": self.q_cu}
        if self.kv_cu is not None:
            named["kv_cu_seq_lens"] = self.kv_cu
        return named

    def __str__(self) -> str:
        lse = " lse" if self.return_lse else ""
        kv = "" if self.kv_cu is None else f" kv_cu {self.kv_cu.tolist()}"
        mask = "causal" if self.causal else "full"
        return f"{self.name} (q_cu {self.q_cu.tolist()}{kv}, {mask}{lse})"


#: (q_lens, kv_lens or None, causal, return_lse): 1..2048 tokens, one to several sequences,
#: causal and not, keys longer than queries, with and without an LSE
CASE_SPECS: dict[str, tuple[list[int], list[int] | None, bool, bool]] = {
    "one_token": ([1], None, True, False),
    "one_query_long_kv": ([1], [300], True, True),
    "short_batch": ([16] * 8, None, True, False),
    "ragged_full_lse": ([5, 64, 1, 33, 130], None, False, True),
    "prefix_cached": ([3, 16, 40, 1], [10, 16, 100, 64], True, False),
    "context_chunk": ([64] * 4, [512] * 4, False, True),
    "mixed": ([512, 256, 128, 64, 32, 8], None, True, False),
    "mixed_kv_lse": ([256, 128, 7], [1024, 512, 7], True, True),
    "big_full": ([2048], None, False, False),  # out 2 MiB
    "big_causal_lse": ([2048], None, True, True),  # out 2 MiB, lse 32 KiB
    "big_ragged_kv": ([1024, 512, 512], [2048, 512, 1024], True, False),  # out 2 MiB
    "medium_full_lse": ([700, 300], [900, 300], False, True),
    "two_tokens_lse": ([1, 1], [1, 40], False, True),
    "decode_like": ([1] * 16, [64] * 16, True, False),
}


def make_cases() -> list[Case]:
    """`CASE_SPECS` as bf16 tensors, each with the library's answer."""
    cases = []
    for seed, (name, (q_lens, kv_lens, causal, lse)) in enumerate(CASE_SPECS.items()):
        q, k, v, q_cu, kv_cu = make_batch(BatchSpec(q_lens, kv_lens), MLA, torch.bfloat16, seed)
        got = zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, causal=causal, return_lse=lse)
        want = tuple(got) if lse else (got,)
        cases.append(Case(name, q, k, v, q_cu, kv_cu, causal, lse, want))
    return cases


# -- outcomes -------------------------------------------------------------------------------------


class WrongAnswerError(Exception):
    """An answer that is not the library's."""


def check(case: Case, got: tuple[torch.Tensor, ...]) -> None:
    """Raise WrongAnswerError unless `got` is the library's answer to `case` bit for bit; the
    message says how far off it is, and whether it is within the fp64 reference's tolerance."""
    if len(got) != len(case.want):
        raise WrongAnswerError(f"{len(got)} outputs, wanted {len(case.want)}")
    for name, g, w in zip(("out", "lse"), got, case.want, strict=False):
        if g.shape != w.shape or g.dtype != w.dtype:
            raise WrongAnswerError(
                f"{name}: {g.dtype} {tuple(g.shape)}, wanted {w.dtype} {tuple(w.shape)}"
            )
    if all(torch.equal(g, w) for g, w in zip(got, case.want, strict=True)):
        return
    diffs = []
    for name, g, w in zip(("out", "lse"), got, case.want, strict=False):
        finite = torch.isfinite(w)
        diff = (g.float() - w.float()).abs()[finite]
        bad = g != w
        if not bad.any():
            continue
        diffs.append(
            f"{name}: {int(bad.sum())} elements differ, max |diff| {diff.max().item():.3g}, "
            f"{_where(bad, token_dim=0 if name == 'out' else 1)}"
            + (", all of them 0 in the answer" if bool((g[bad] == 0).all()) else "")
        )
    try:
        out, lse = got if case.return_lse else (got[0], None)
        assert_close_to_reference(
            case.q, case.k, case.v, case.q_cu, case.kv_cu, case.causal, out, lse
        )
        verdict = "within the fp64 reference's tolerance"
    except AssertionError as exc:
        verdict = f"OFF the fp64 reference: {str(exc)[:200]}"
    raise WrongAnswerError(f"not the library's answer ({'; '.join(diffs)}), {verdict}")


def _spans(indices: list[int]) -> str:
    """[3, 4, 5, 9] as "3-5, 9"."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans[:8]) + (
        ", ..." if len(spans) > 8 else ""
    )


def _where(bad: torch.Tensor, token_dim: int) -> str:
    """Which tokens and heads hold the differing elements of `out` [Tq, H, Dv] or `lse`
    [H, Tq]."""
    head_dim = 1 - token_dim
    others = [d for d in range(bad.ndim) if d != token_dim]
    tokens = bad.any(dim=others[0]) if len(others) == 1 else bad.any(dim=others[1]).any(dim=1)
    heads = bad.transpose(0, head_dim).reshape(bad.shape[head_dim], -1).any(dim=1)
    return (
        f"tokens {_spans(tokens.nonzero().flatten().tolist())}, "
        f"heads {heads.nonzero().flatten().tolist()}"
    )


@dataclass
class Outcome:
    route: str
    caller: str
    case: str
    seconds: float
    kind: str  # "ok", "wrong", "deadline", or the error's class name
    message: str = ""


def classify(exc: BaseException) -> str:
    if isinstance(exc, WrongAnswerError):
        return "wrong"
    if isinstance(exc, DeadlineExceededError | httpx.TimeoutException):
        return "deadline"
    if type(exc).__name__ in ("Timeout", "timeout", "TimeoutError") or isinstance(
        exc, TimeoutError
    ):
        return "deadline"
    return type(exc).__name__


@dataclass
class Tally:
    """Every call's outcome; `lock` guards `outcomes` and `hung`."""

    outcomes: list[Outcome] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)  # callers still running when joined
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def by_route(self) -> dict[str, Counter[str]]:
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        for o in self.outcomes:
            counts[o.route][o.kind] += 1
        return dict(counts)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind != "ok"]

    def report(self, limit: int = 8) -> str:
        lines = []
        for route, counts in sorted(self.by_route().items()):
            times = [o.seconds for o in self.outcomes if o.route == route]
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
            lines.append(
                f"  {route:12s} {sum(counts.values()):4d} calls: {kinds}; "
                f"slowest {max(times):.2f} s"
            )
        failed = self.failures()
        if failed:
            lines.append(f"  first {min(limit, len(failed))} of {len(failed)} failures:")
            for o in failed[:limit]:
                lines.append(
                    f"    [{o.route}/{o.caller}] {o.case} after {o.seconds:.2f} s: "
                    f"{o.kind}: {o.message[:400]}"
                )
        if self.hung:
            lines.append(f"  callers still running when joined: {', '.join(self.hung)}")
        return "\n".join(lines)


# -- the callers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How long callers run: each makes at most `calls` calls, starting none after `seconds`;
    `timeout`: one call's whole budget on the client's side (above the server's deadline, so
    that the server's 504 comes first)."""

    calls: int = 1000
    seconds: float = 20.0
    timeout: float = 20.0


#: every this many calls a caller makes a large one (an answer over 1 MiB); the others are
#: small, so that workers go idle between calls and small ones are lent to the event loop
LARGE_EVERY = 4


def _loop_cases(cases: list[Case], start: int, plan: Plan) -> Iterator[Case]:
    small = [c for c in cases if not c.large]
    large = [c for c in cases if c.large]
    end = time.monotonic() + plan.seconds
    for i in range(plan.calls):
        if time.monotonic() >= end:
            return
        if i % LARGE_EVERY == LARGE_EVERY - 1:
            yield large[(start + i // LARGE_EVERY) % len(large)]
        else:
            yield small[(start + i) % len(small)]


def _failure(exc: Exception) -> tuple[str, str]:
    """A failed call's kind and message (its cause too, and where it was raised when it is not
    one of zen_mla's errors)."""
    message = f"{exc!r}"
    if exc.__cause__ is not None:
        message += f" (from {exc.__cause__!r})"
    kind = classify(exc)
    if kind not in ("wrong", "deadline") and not isinstance(exc, ZenMLAError):
        message += " | " + " ".join(traceback.format_exception(exc)[-3:])
    return kind, message


def _record(tally: Tally, route: str, caller: str, case: Case, fn: Callable[[], tuple]) -> None:
    t0 = time.monotonic()
    try:
        check(case, fn())
        tally.add(Outcome(route, caller, str(case), time.monotonic() - t0, "ok"))
    except Exception as exc:
        tally.add(Outcome(route, caller, str(case), time.monotonic() - t0, *_failure(exc)))


def _as_tuple(got: object) -> tuple[torch.Tensor, ...]:
    return tuple(got) if isinstance(got, tuple) else (got,)  # type: ignore[arg-type]


def _retried(call: Callable[[], tuple], deadline: float) -> tuple:
    """`call()`, again after a QueueFullError's Retry-After, as the library clients do."""
    for attempt in range(RETRIES + 1):
        try:
            return call()
        except QueueFullError as exc:
            wait = exc.retry_after if exc.retry_after is not None else 0.5 * 2**attempt
            if attempt == RETRIES or time.monotonic() + wait >= deadline:
                raise
            time.sleep(wait)
    raise AssertionError("unreachable")


def _prefill(client: PrefillClient, case: Case) -> tuple[torch.Tensor, ...]:
    got = client.prefill(
        case.q, case.k, case.v, case.q_cu, case.kv_cu,
        causal=case.causal, return_lse=case.return_lse,
    )  # fmt: skip
    return _as_tuple(got)


def client_caller(route: str, shared_memory: bool) -> Callable[..., None]:
    """A thread's caller on one `PrefillClient` of its own."""

    def run(server: Server, cases: list[Case], start: int, plan: Plan, tally: Tally) -> None:
        name = f"{route}{start}"
        with PrefillClient(server.url, shared_memory=shared_memory, timeout=plan.timeout) as c:
            for case in _loop_cases(cases, start, plan):
                _record(tally, route, name, case, functools.partial(_prefill, c, case))

    return run


def _problem(r: httpx.Response) -> ZenMLAError:
    """The zen_mla exception a non-200 answer stands for, with its detail."""
    try:
        detail = r.json().get("detail") or r.text
    except ValueError:
        detail = r.text
    cls = BY_STATUS.get(r.status_code, ZenMLAError)
    message = f"HTTP {r.status_code}: {str(detail)[:300]}"
    if issubclass(cls, zen_mla.InvalidInputError):
        return cls("request", "one the service accepts", message)
    exc = cls(message)
    if isinstance(exc, QueueFullError):
        exc.retry_after = float(r.headers.get("retry-after", 1))
    return exc


def regions_http_caller(
    server: Server, cases: list[Case], start: int, plan: Plan, tally: Tally
) -> None:
    """Regions JSON bodies over HTTP, their tensors in regions of this caller's own connection
    to the region socket."""
    name = f"regions_http{start}"
    offer = server.health()["shared_memory"]
    sock = RegionConnection(offer["socket"], None, timeout=plan.timeout)
    regions = RegionSet(sock)
    headers = {"Content-Type": rr.MEDIA_TYPE}

    def one(http: httpx.Client, case: Case) -> tuple[torch.Tensor, ...]:
        options = options_metadata(causal=case.causal, return_lse=case.return_lse, scale=None)
        with regions.request(case.tensors, case.return_lse) as layout:
            body = rr.encode(layout.places, options)

            def post() -> tuple[torch.Tensor, ...]:
                r = http.post("/prefill", content=body, headers=headers)
                if r.status_code != 200:
                    raise _problem(r)
                answer = rr.decode(r.content, frozenset({"out", "lse"}))
                if answer.places != {n: layout.places[n] for n in answer.places}:
                    raise WrongAnswerError(
                        f"answered places {answer.places}, asked {layout.places}"
                    )
                got = (layout.out.clone(),)
                return got + ((layout.lse.clone(),) if layout.lse is not None else ())

            return _retried(post, time.monotonic() + plan.timeout)

    try:
        with httpx.Client(base_url=server.url, timeout=plan.timeout) as http:
            for case in _loop_cases(cases, start, plan):
                _record(tally, "regions_http", name, case, lambda case=case: one(http, case))
    finally:
        regions.close()


def v2_caller(server: Server, cases: list[Case], start: int, plan: Plan, tally: Tally) -> None:
    """`/v2/models/mla_prefill/infer`, binary tensor data, by tritonclient (one per thread)."""
    from tritonclient.http import InferenceServerClient, InferenceServerException, InferInput
    from tritonclient.utils import np_to_triton_dtype

    name = f"v2_{start}"

    def one(client: InferenceServerClient, case: Case) -> tuple[torch.Tensor, ...]:
        inputs = []
        for n, t in case.tensors.items():
            a = to_numpy(t)
            i = InferInput(n, list(a.shape), np_to_triton_dtype(a.dtype))
            i.set_data_from_numpy(a, binary_data=True)
            inputs.append(i)
        params = {"causal": case.causal, "return_lse": case.return_lse}

        def infer() -> tuple[torch.Tensor, ...]:
            try:
                result = client.infer("mla_prefill", inputs, parameters=params)
            except InferenceServerException as exc:
                status = int(exc.status()) if str(exc.status()).isdigit() else 0
                cls = BY_STATUS.get(status, ZenMLAError)
                message = f"v2 {exc.status()}: {exc.message()}"
                if issubclass(cls, zen_mla.InvalidInputError):
                    raise cls("request", "one the service accepts", message) from exc
                raised = cls(message)
                if isinstance(raised, QueueFullError):
                    raised.retry_after = 1.0
                raise raised from exc
            out, lse = result.as_numpy("out"), result.as_numpy("lse")
            got = (to_torch(out),)
            return got + ((to_torch(lse),) if lse is not None else ())

        return _retried(infer, time.monotonic() + plan.timeout)

    netloc = urlparse(server.url).netloc
    with InferenceServerClient(
        netloc, connection_timeout=plan.timeout, network_timeout=plan.timeout
    ) as client:
        for case in _loop_cases(cases, start, plan):
            _record(tally, "v2", name, case, lambda case=case: one(client, case))


def async_callers(tasks: int) -> Callable[..., None]:
    """`tasks` tasks on one `AsyncPrefillClient` (automatic: the region socket, or regions JSON
    over HTTP while another task holds it), in one event loop in this thread."""

    def run(server: Server, cases: list[Case], start: int, plan: Plan, tally: Tally) -> None:
        async def task(client: AsyncPrefillClient, first: int) -> None:
            name = f"async{first}"
            for case in _loop_cases(cases, first, plan):
                t0 = time.monotonic()
                try:
                    got = await client.prefill(
                        case.q, case.k, case.v, case.q_cu, case.kv_cu,
                        causal=case.causal, return_lse=case.return_lse,
                    )  # fmt: skip
                    check(case, _as_tuple(got))
                    outcome = Outcome("async", name, str(case), time.monotonic() - t0, "ok")
                except Exception as exc:
                    took = time.monotonic() - t0
                    outcome = Outcome("async", name, str(case), took, *_failure(exc))
                tally.add(outcome)

        async def main() -> None:
            async with AsyncPrefillClient(server.url, timeout=plan.timeout) as client:
                await asyncio.gather(*(task(client, start + i) for i in range(tasks)))

        asyncio.run(main())

    return run


# -- over MLA's latent cache ----------------------------------------------------------------------

LATENT_RANK, LATENT_ROPE = 512, 64


@dataclass(frozen=True)
class LatentCase:
    """A case's queries over a latent context as long as its keys, and the library's answer."""

    kv_c: torch.Tensor
    k_pe: torch.Tensor
    want: tuple[torch.Tensor, ...]


def latent_weight() -> torch.Tensor:
    """The latent caller's `kv_b_proj` weight: MLA's heads, their Dn (192 - 64) and Dv rows."""
    heads, dqk, dv = MLA
    gen = torch.Generator().manual_seed(77)
    w = torch.randn(heads * (dqk - LATENT_ROPE + dv), LATENT_RANK, generator=gen)
    return (w / LATENT_RANK**0.5).bfloat16()


def latent_case(case: Case, w_kv_b: torch.Tensor) -> LatentCase:
    tk = int(case.k.shape[0])
    gen = torch.Generator().manual_seed(tk)
    kv_c = torch.randn(tk, LATENT_RANK, generator=gen).bfloat16()
    k_pe = torch.randn(tk, LATENT_ROPE, generator=gen).bfloat16()
    got = zen_mla.latent_attention(
        case.q, kv_c, k_pe, w_kv_b, case.q_cu, case.kv_cu,
        causal=case.causal, return_lse=case.return_lse,
    )  # fmt: skip
    return LatentCase(kv_c, k_pe, _as_tuple(got))


def check_latent(x: LatentCase, got: tuple[torch.Tensor, ...]) -> None:
    """Raise WrongAnswerError unless `got` is the library's answer within a rounding of bf16
    (out) and 1e-4 (lse), -inf where it is."""
    if [(g.shape, g.dtype) for g in got] != [(w.shape, w.dtype) for w in x.want]:
        raise WrongAnswerError(f"{[(g.dtype, tuple(g.shape)) for g in got]}, wanted {x.want!r:.80}")
    for name, g, w, tol in zip(("out", "lse"), got, x.want, (2**-6, 1e-4), strict=False):
        finite = torch.isfinite(w)
        if not torch.equal(finite, torch.isfinite(g)):
            raise WrongAnswerError(f"{name}: not finite where the library's is, or the other way")
        off = (g.float() - w.float()).abs()[finite].max().item() if finite.any() else 0.0
        if off > tol:
            raise WrongAnswerError(f"{name}: max |diff| {off:.3g} from the library's")


def latent_caller(route: str, shared_memory: bool) -> Callable[..., None]:
    """A thread's `PrefillClient` calling over the latent cache, its answers checked against
    in-process `latent_attention`."""

    def run(server: Server, cases: list[Case], start: int, plan: Plan, tally: Tally) -> None:
        _latent_calls(server, cases, f"{route}{start}", route, shared_memory, start, plan, tally)

    return run


def _latent_calls(
    server: Server,
    cases: list[Case],
    name: str,
    route: str,
    shared_memory: bool,
    start: int,
    plan: Plan,
    tally: Tally,
) -> None:
    w = latent_weight()
    latent = {c.name: latent_case(c, w) for c in cases}

    def one(client: PrefillClient, case: Case) -> tuple[torch.Tensor, ...]:
        x = latent[case.name]
        got = client.prefill_latent(
            case.q, x.kv_c, x.k_pe, "many-clients", case.q_cu, case.kv_cu,
            causal=case.causal, return_lse=case.return_lse,
        )  # fmt: skip
        return _as_tuple(got)

    with PrefillClient(server.url, shared_memory=shared_memory, timeout=plan.timeout) as client:
        client.register_weight("many-clients", w)
        for case in _loop_cases(cases, start, plan):
            x = latent[case.name]
            t0 = time.monotonic()
            try:
                check_latent(x, one(client, case))
                outcome = Outcome(route, name, str(case), time.monotonic() - t0, "ok")
            except Exception as exc:
                outcome = Outcome(route, name, str(case), time.monotonic() - t0, *_failure(exc))
            tally.add(outcome)


# -- the server's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerState:
    """What says whether workers were replaced, and the service's own counts of answers."""

    workers: tuple[tuple[int, int | None, int, bool], ...]  # id, pid, restarts, alive
    restarts_total: int
    requests: dict[tuple[str, str], int]  # (route, status) -> answered

    def __str__(self) -> str:
        workers = ", ".join(
            f"worker {i}: pid {pid}, restarts {n}, {'alive' if alive else 'NOT alive'}"
            for i, pid, n, alive in self.workers
        )
        return f"{workers}; zen_mla_worker_restarts_total {self.restarts_total}"


_REQUESTS = re.compile(r'^zen_mla_requests_total\{route="([^"]+)",status="(\d+)"\} (\S+)$')


def server_state(server: Server) -> ServerState:
    health = server.health()
    workers = tuple(
        (w["id"], w.get("pid"), int(w.get("restarts", 0)), bool(w["alive"]))
        for w in health["workers"]
    )
    with server.client() as c:
        text = c.get("/metrics").text
    restarts, requests = -1, {}
    for line in text.splitlines():
        if line.startswith("zen_mla_worker_restarts_total "):
            restarts = int(float(line.split()[1]))
        elif m := _REQUESTS.match(line):
            requests[(m[1], m[2])] = int(float(m[3]))
    return ServerState(workers, restarts, requests)


def answered_since(before: ServerState, after: ServerState) -> str:
    """The service's answers by route and status between two states."""
    keys = sorted(set(before.requests) | set(after.requests))
    counts = [(k, after.requests.get(k, 0) - before.requests.get(k, 0)) for k in keys]
    return ", ".join(f"{route} {status}: {n}" for (route, status), n in counts if n)


# -- all at once ----------------------------------------------------------------------------------

#: (route, caller, how many): 8 calls in flight at most, the default --max-queue
CALLERS: list[tuple[str, Callable[..., None], int]] = [
    ("socket", client_caller("socket", shared_memory=True), 2),
    ("regions_http", regions_http_caller, 1),
    ("safetensors", client_caller("safetensors", shared_memory=False), 2),
    ("v2", v2_caller, 1),
    ("async", async_callers(2), 1),  # one thread, two tasks
    ("latent_socket", latent_caller("latent_socket", shared_memory=True), 1),
    ("latent_http", latent_caller("latent_http", shared_memory=False), 1),
]


def run_all(
    server: Server,
    cases: list[Case],
    plan: Plan,
    join_s: float = 45.0,
    callers: list[tuple[str, Callable[..., None], int]] = CALLERS,
) -> Tally:
    """Every caller of `callers` in a thread of its own at once, until each is done or
    `join_s` seconds passed (those still running then are named in `hung`)."""
    tally = Tally()
    threads: list[threading.Thread] = []
    start = 0

    def guarded(route: str, fn: Callable[..., None], first: int) -> None:
        try:
            fn(server, cases, first, plan, tally)
        except Exception as exc:  # a caller that could not start or went down
            tally.add(Outcome(route, f"{route}{first}", "-", 0.0, type(exc).__name__, repr(exc)))

    for route, fn, n in callers:
        for _ in range(n):
            t = threading.Thread(
                target=guarded, args=(route, fn, start), name=f"{route}{start}", daemon=True
            )
            threads.append(t)
            start += 3  # callers start at different cases
    for t in threads:
        t.start()
    end = time.monotonic() + join_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    tally.hung = [t.name for t in threads if t.is_alive()]
    return tally


def then_each_path(server: Server, cases: list[Case], plan: Plan, tally: Tally) -> None:
    """After the load, one at a time until one fails (route `after`): every large case
    (queued for the dispatcher threads, split over the workers) and a small one (lent to the
    event loop), over HTTP and on the region socket. A worker whose dispatcher thread lost its
    way under the load answers no queued work any more, though /health calls it alive."""
    small = next(c for c in cases if not c.large)
    for shared_memory in (False, True):
        name = "after_shm" if shared_memory else "after_http"
        with PrefillClient(server.url, shared_memory=shared_memory, timeout=plan.timeout) as c:
            for case in [*(x for x in cases if x.large), small]:
                _record(tally, "after", name, case, functools.partial(_prefill, c, case))
                if tally.outcomes[-1].kind != "ok":
                    return  # one is enough to tell, and each costs the deadline


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    took = [0.0]
    t0 = time.monotonic()
    try:
        yield took
    finally:
        took[0] = time.monotonic() - t0
