"""A remote MLA prefill backend for vLLM: vLLM's CPU prefill backend methods, computed by zen-mla.

    from zen_mla.vllm import ZenMLARemotePrefillBackend   # subclasses vLLM's MLAPrefillBackend
    register()                                             # ... as vLLM's prefill backend CUSTOM

`ZenMLARemotePrefillBackend` has the methods of vLLM's `CPUSDPAMLAPrefillBackend`
(`prepare_metadata`, `run_prefill_new_tokens`, `run_prefill_context_chunk`) and sends each call to
the service with `zen_mla.client.PrefillClient`. Where vLLM is importable the class subclasses
vLLM's `MLAPrefillBackend`; elsewhere it is `RemotePrefillBackend`, the same methods standing
alone. Importing this module imports neither vLLM nor anything of it.

`prefill_with_context` (and `run_prefill_with_context`) sends a step's new tokens and all its
context chunks at once and merges them by LSE, so a step waits for its slowest piece instead of
the sum of them.

The service's address and token come from `RemoteSettings`, read once from `ZEN_MLA_URL`
(one URL, or several separated by commas) and `ZEN_MLA_API_TOKEN`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import logging
import os
import threading
import types
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, cast, overload

import torch

from ._errors import InvalidInputError, KernelError
from .client import PrefillClient
from .merge import merge_many

__all__ = [
    "ContextKV",
    "RemotePrefillBackend",
    "RemoteSettings",
    "ZenMLARemotePrefillBackend",
    "backend_class",
    "default_settings",
    "prefill_with_context",
    "register",
    "service_ready",
]

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_CONCURRENCY = 8
VLLM_BASE = "vllm.v1.attention.backends.mla.prefill.base"
VLLM_REGISTRY = "vllm.v1.attention.backends.mla.prefill.registry"


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """Where the service is and how to reach it.

    `urls`: one base URL or more (requests go to the least loaded, see `PrefillClient`).
    `token`: the bearer token, None when the service has none. `health_timeout_s`: how long
    `is_available` waits for `/health`. `max_concurrency`: requests one process keeps in flight
    for `prefill_with_context`.
    """

    urls: tuple[str, ...] = (DEFAULT_URL,)
    token: str | None = field(default=None, repr=False)  # kept out of logs
    health_timeout_s: float = 3.0
    max_concurrency: int = DEFAULT_CONCURRENCY

    def __post_init__(self) -> None:
        if not self.urls:
            raise InvalidInputError("ZEN_MLA_URL", "one http(s) URL or more", "none")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise InvalidInputError(
                    "ZEN_MLA_URL", "http://host:port or https://host:port", repr(url)
                )
        if self.token is not None and not self.token.strip():
            # The service refuses to start with an empty token; a client sending none would get
            # 401 from a guarded service and hide the misconfiguration from an open one.
            raise InvalidInputError(
                "ZEN_MLA_API_TOKEN",
                "a non-empty token, or the variable unset",
                "an empty string",
                "An empty token is not a token",
            )
        if self.max_concurrency < 1:
            raise InvalidInputError("max_concurrency", "1 or more", str(self.max_concurrency))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RemoteSettings:
        """From `ZEN_MLA_URL` (comma-separated for several endpoints; default
        `http://127.0.0.1:8000`) and `ZEN_MLA_API_TOKEN` (unset: no token; set but empty:
        refused, as the service refuses it)."""
        env = os.environ if environ is None else environ
        raw = env.get("ZEN_MLA_URL", DEFAULT_URL)
        urls = tuple(u.strip() for u in raw.split(",") if u.strip())
        return cls(urls=urls, token=env.get("ZEN_MLA_API_TOKEN"))


@functools.cache
def default_settings() -> RemoteSettings:
    """`RemoteSettings.from_env()`, read once per process (`default_settings.cache_clear()`
    reads the environment again)."""
    return RemoteSettings.from_env()


@functools.cache
def service_ready(settings: RemoteSettings) -> bool:
    """Whether any of the settings' endpoints answers `/health` with status "ok"; decided once
    per settings (`service_ready.cache_clear()` asks again). Never raises."""
    for url in settings.urls:
        try:
            with PrefillClient(
                url, token=settings.token, timeout=settings.health_timeout_s, retries=0
            ) as client:
                health = client.health()
        except Exception as exc:  # unreachable, refused, not JSON: all mean "not available"
            logger.warning("zen-mla at %s is not available: %s", url, exc)
            continue
        if health.get("status") == "ok":
            return True
        logger.warning("zen-mla at %s is not ready: status %r", url, health.get("status"))
    return False


class _Shared:
    """The client every backend of one `RemoteSettings` uses, and the thread pools that send a
    step's pieces: vLLM builds one backend per attention layer, and 61 layers need not hold 61
    connection pools.

    `_lock` guards `_clients` and `_pools`; a `PrefillClient` is safe to call from several
    threads (httpx's pool and the client's balancer have their own locks)."""

    _lock = threading.Lock()
    _clients: ClassVar[dict[RemoteSettings, PrefillClient]] = {}
    _pools: ClassVar[dict[int, ThreadPoolExecutor]] = {}  # by size

    @classmethod
    def client(cls, settings: RemoteSettings) -> PrefillClient:
        with cls._lock:
            if settings not in cls._clients:
                cls._clients[settings] = PrefillClient(list(settings.urls), token=settings.token)
            return cls._clients[settings]

    @classmethod
    def pool(cls, max_concurrency: int) -> ThreadPoolExecutor:
        with cls._lock:
            if max_concurrency not in cls._pools:
                cls._pools[max_concurrency] = ThreadPoolExecutor(
                    max_concurrency, thread_name_prefix="zen-mla-prefill"
                )
            return cls._pools[max_concurrency]


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


def _check_out(out: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> None:
    want = (q.shape[0], q.shape[1], v.shape[-1])
    if tuple(out.shape) != want or out.dtype != v.dtype:
        raise InvalidInputError(
            "out", f"{list(want)} {str(v.dtype).removeprefix('torch.')} (v's dtype)", _describe(out)
        )


def _check_result(out: torch.Tensor, lse: torch.Tensor | None, q: torch.Tensor, dv: int) -> None:
    """The edge to the network: a reply of the wrong shape is an error, never numbers."""
    t, h = q.shape[0], q.shape[1]
    if tuple(out.shape) != (t, h, dv):
        raise KernelError(f"the service sent out {_describe(out)}, expected {[t, h, dv]}")
    if lse is not None and (tuple(lse.shape) != (h, t) or lse.dtype != torch.float32):
        raise KernelError(f"the service sent lse {_describe(lse)}, expected {[h, t]} float32")


def _call(
    client: PrefillClient,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu: torch.Tensor,
    kv_cu: torch.Tensor | None,
    *,
    causal: bool,
    return_lse: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    got = client.prefill(q, k, v, q_cu, kv_cu, causal=causal, return_lse=return_lse, scale=scale)
    out, lse = got if isinstance(got, tuple) else (got, None)
    _check_result(out, lse, q, v.shape[-1])
    return out, lse


@overload
def prefill_with_context(
    client: PrefillClient,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    context: Sequence[ContextKV],
    *,
    scale: float | None = None,
    return_lse: Literal[False] = False,
    out: torch.Tensor | None = None,
    executor: Executor | None = None,
) -> torch.Tensor: ...
@overload
def prefill_with_context(
    client: PrefillClient,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    context: Sequence[ContextKV],
    *,
    scale: float | None = None,
    return_lse: Literal[True],
    out: torch.Tensor | None = None,
    executor: Executor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...
def prefill_with_context(
    client: PrefillClient,
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
        client: the service (several endpoints spread the pieces).
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
        _check_out(out, q, v)
    if not context:
        new_out, new_lse = _call(
            client, q, k, v, query_start_loc, None, causal=True, return_lse=return_lse, scale=scale
        )
        if out is not None:
            out.copy_(new_out)
            new_out = out
        return (new_out, _lse(new_lse)) if return_lse else new_out

    pool = executor if executor is not None else _Shared.pool(DEFAULT_CONCURRENCY)
    pieces = [
        pool.submit(
            _call, client, q, k, v, query_start_loc, None, causal=True, return_lse=True, scale=scale
        )
    ]
    pieces += [
        pool.submit(
            _call,
            client,
            q,
            c.k,
            c.v,
            query_start_loc,
            c.cu_seq_lens,
            causal=False,
            return_lse=True,
            scale=scale,
        )
        for c in context
    ]
    concurrent.futures.wait(pieces)
    results = [p.result() for p in pieces]  # raises the first piece's error, in order
    merged, merged_lse = merge_many(
        [o for o, _ in results], [_lse(x) for _, x in results], output=out
    )
    return (merged, merged_lse) if return_lse else merged


def _lse(lse: torch.Tensor | None) -> torch.Tensor:
    if lse is None:
        raise KernelError("the service sent no lse where one was asked for")
    return lse


class _PrefillMetadata(Protocol):
    query_start_loc: torch.Tensor


class _ContextChunk(Protocol):
    query_start_loc: torch.Tensor
    cu_seq_lens: torch.Tensor


class RemotePrefillBackend:
    """vLLM's MLA prefill backend interface, computed by the zen-mla service.

    Built as vLLM builds its prefill backends; `settings` (keyword only, not vLLM's) overrides
    `default_settings()`. Tensors may live on any device: they travel as CPU tensors and results
    come back on the caller's device. Every failure is an exception carrying the service's
    message (the `zen_mla` error tree), never a result.
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    requires_r1_mla_dimensions: ClassVar[bool] = False

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        vllm_config: Any,
        *,
        settings: RemoteSettings | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.scale = scale
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.vllm_config = vllm_config
        self.settings = settings if settings is not None else default_settings()
        self.client = _Shared.client(self.settings)
        self._prefill_metadata: _PrefillMetadata | None = None

    @staticmethod
    def get_name() -> str:
        return "ZEN_MLA_REMOTE"

    @classmethod
    def is_available(cls) -> bool:
        """Whether the configured service answers `/health` as ready; decided once per process
        (see `service_ready`). Never raises."""
        try:
            settings = default_settings()
        except InvalidInputError as exc:
            logger.warning("zen-mla is not configured: %s", exc)
            return False
        return service_ready(settings)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    def supports_out(self) -> bool:
        return True

    def prepare_metadata(self, prefill_metadata: _PrefillMetadata) -> None:
        """Keeps the step's prefill metadata; its `query_start_loc` (`[B + 1]` int32 offsets of
        each request's new tokens) is what the next calls use."""
        self._prefill_metadata = prefill_metadata

    def _query_start_loc(self) -> torch.Tensor:
        if self._prefill_metadata is None:
            raise InvalidInputError(
                "prefill_metadata", "prepare_metadata(...) called before a prefill", "none"
            )
        return self._prefill_metadata.query_start_loc

    @overload
    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: Literal[False],
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
    @overload
    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: Literal[True],
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    @overload
    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of the new tokens over themselves.

        Args:
            q, k: `[T, H, Dqk]`; v: `[T, H, Dv]` (bf16, fp16 or fp32, one dtype); rows by
                `query_start_loc` for q and kv alike.
            return_softmax_lse: also return the LSE `[H, T]` fp32, natural log.
            out: `[T, H, Dv]` in v's dtype, written in place when given.
            output_scale: must be None (no fused FP8 output, as vLLM's CPU backend).

        Returns:
            out `[T, H, Dv]`, or `(out, lse)`.
        """
        if output_scale is not None:
            raise InvalidInputError(
                "output_scale", "None (no fused FP8 output on CPU prefill)", "a tensor"
            )
        if out is not None:
            _check_out(out, q, v)
        result, lse = _call(
            self.client,
            q,
            k,
            v,
            self._query_start_loc(),
            None,
            causal=True,
            return_lse=return_softmax_lse,
            scale=self.scale,
        )
        if out is not None:
            out.copy_(result)
            result = out
        return (result, _lse(lse)) if return_softmax_lse else result

    def run_prefill_context_chunk(
        self,
        chunk: _ContextChunk,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of the new tokens over one chunk of cached context.

        Args:
            chunk: its `query_start_loc` (`[B + 1]`, rows of q) and `cu_seq_lens` (`[B + 1]`,
                rows of k/v; a request may have no keys in this chunk: out 0, lse -inf).
            q: `[T, H, Dqk]`; k: `[Tk, H, Dqk]`; v: `[Tk, H, Dv]`.
            out: `[T, H, Dv]` in v's dtype, written in place when given.

        Returns:
            `(out, lse)`: `[T, H, Dv]` and `[H, T]` fp32, natural log.
        """
        if out is not None:
            _check_out(out, q, v)
        result, lse = _call(
            self.client,
            q,
            k,
            v,
            chunk.query_start_loc,
            chunk.cu_seq_lens,
            causal=False,
            return_lse=True,
            scale=self.scale,
        )
        if out is not None:
            out.copy_(result)
            result = out
        return result, _lse(lse)

    @overload
    def run_prefill_with_context(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        context: Sequence[ContextKV],
        return_softmax_lse: Literal[False] = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
    @overload
    def run_prefill_with_context(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        context: Sequence[ContextKV],
        return_softmax_lse: Literal[True],
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def run_prefill_with_context(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        context: Sequence[ContextKV],
        return_softmax_lse: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """New tokens and all context chunks of the step at once (not vLLM's: an orchestrator
        that has gathered the whole context calls this instead of `run_prefill_new_tokens` and
        one `run_prefill_context_chunk` per chunk). See `prefill_with_context`."""
        if return_softmax_lse:
            return prefill_with_context(
                self.client,
                q,
                k,
                v,
                self._query_start_loc(),
                context,
                scale=self.scale,
                return_lse=True,
                out=out,
                executor=_Shared.pool(self.settings.max_concurrency),
            )
        return prefill_with_context(
            self.client,
            q,
            k,
            v,
            self._query_start_loc(),
            context,
            scale=self.scale,
            out=out,
            executor=_Shared.pool(self.settings.max_concurrency),
        )


@functools.cache
def backend_class() -> type[RemotePrefillBackend]:
    """`RemotePrefillBackend` with vLLM's `MLAPrefillBackend` as a second base where vLLM is
    importable (vLLM's selector checks `issubclass`-level things such as
    `validate_configuration`), else `RemotePrefillBackend` itself."""
    try:
        base = importlib.import_module(VLLM_BASE).MLAPrefillBackend
    except (ImportError, AttributeError):
        return RemotePrefillBackend
    # MLAPrefillBackend is an ABC; RemotePrefillBackend comes first in the MRO, so its methods
    # are the ones that count, the abstract ones included.
    cls = types.new_class(
        "ZenMLARemotePrefillBackend",
        (RemotePrefillBackend, base),
        exec_body=lambda ns: ns.update(__module__=__name__),
    )
    return cast("type[RemotePrefillBackend]", cls)


def register() -> None:
    """Register the backend as vLLM's MLA prefill backend `CUSTOM` (a `vllm.general_plugins`
    entry point, or call it before the engine starts); select it with
    `--attention-config '{"mla_prefill_backend": "CUSTOM"}'`."""
    registry = importlib.import_module(VLLM_REGISTRY)
    registry.register_mla_prefill_backend(
        registry.MLAPrefillBackendEnum.CUSTOM, f"{__name__}.ZenMLARemotePrefillBackend"
    )


if TYPE_CHECKING:
    ZenMLARemotePrefillBackend = RemotePrefillBackend
else:

    def __getattr__(name: str) -> object:
        if name == "ZenMLARemotePrefillBackend":
            return backend_class()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
