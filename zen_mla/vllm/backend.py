"""zen-mla's MLA prefill backend: vLLM's CPU prefill backend methods, computed by the service (or
here while it is down, see `link`), or in this process (`ZEN_MLA_URL=local`, see `local`)."""

from __future__ import annotations

import functools
import importlib
import logging
import types
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, cast

import torch

from ..client import PrefillClient
from ..errors import InvalidInputError
from ..wire import PrefillOptions
from .context import ContextKV, call, check_out, lse_of, prefill_with_context
from .link import ServiceLink
from .local import LocalPrefiller
from .settings import LocalSettings, Settings, default_settings, service_ready

__all__ = ["BACKEND_NAME", "VLLM_BASE", "RemotePrefillBackend", "backend_class"]

logger = logging.getLogger("zen_mla.vllm")

BACKEND_NAME = "ZEN_MLA"
VLLM_BASE = "vllm.v1.attention.backends.mla.prefill.base"


class _PrefillMetadata(Protocol):
    query_start_loc: torch.Tensor


class _ContextChunk(Protocol):
    query_start_loc: torch.Tensor
    cu_seq_lens: torch.Tensor


class RemotePrefillBackend:
    """vLLM's MLA prefill backend interface, computed by the zen-mla service, or by zen-mla's
    kernels in this process (`LocalSettings`).

    Built as vLLM builds its prefill backends; `settings` (keyword only, not vLLM's) overrides
    `default_settings()` and survives `clone()`. Tensors may live on any device: they travel as
    CPU tensors and results come back on the caller's device. While the service cannot be
    reached, calls are computed in this process (`RemoteSettings.fallback`, see `link`); with
    the fallback off, every failure is an exception carrying the service's message (the
    `zen_mla` error tree), never a result.
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
        settings: Settings | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.scale = scale
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.vllm_config = vllm_config
        self.settings = settings if settings is not None else default_settings()
        self.link: LocalPrefiller | ServiceLink = (
            LocalPrefiller(self.settings)
            if isinstance(self.settings, LocalSettings)
            else ServiceLink.of(self.settings)
        )
        self._prefill_metadata: _PrefillMetadata | None = None

    @property
    def client(self) -> PrefillClient:
        """The client every backend of these settings shares (replaced after an outage); in
        process there is none (`InvalidInputError`)."""
        if not isinstance(self.link, ServiceLink):
            raise InvalidInputError(
                "client", "a backend of a service (ZEN_MLA_URL an http(s) URL)", "ZEN_MLA_URL=local"
            )
        return self.link.client

    def clone(self) -> RemotePrefillBackend:
        """A backend of the same arguments and settings (vLLM runs only clones: one per
        metadata builder)."""
        return type(self)(
            self.num_heads,
            self.scale,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.vllm_config,
            settings=self.settings,
        )

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def is_available(cls) -> bool:
        """Whether the backend can run with the environment's settings: always with the
        fallback (the service's state is the link's business, call by call); without it,
        whether the service answers `/health` as ready, decided once per process (see
        `service_ready`). In process: always. False for settings that cannot be read. Never
        raises."""
        try:
            settings = default_settings()
        except InvalidInputError as exc:
            logger.warning("zen-mla is not configured: %s", exc)
            return False
        if isinstance(settings, LocalSettings):
            return True
        return settings.fallback or service_ready(settings)

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
            check_out(out, q, v)
        result, lse = call(
            self.link,
            (q, k, v, self._query_start_loc(), None),
            PrefillOptions(causal=True, return_lse=return_softmax_lse, scale=self.scale),
            out,
        )
        return (result, lse_of(lse)) if return_softmax_lse else result

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
            check_out(out, q, v)
        result, lse = call(
            self.link,
            (q, k, v, chunk.query_start_loc, chunk.cu_seq_lens),
            PrefillOptions(causal=False, return_lse=True, scale=self.scale),
            out,
        )
        return result, lse_of(lse)

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
        one `run_prefill_context_chunk` per chunk). See `prefill_with_context`: the pieces go to
        the service at once, or are computed here one after another (each on all of this
        thread's cores)."""
        return prefill_with_context(
            self.link,
            q,
            k,
            v,
            self._query_start_loc(),
            context,
            scale=self.scale,
            return_lse=return_softmax_lse,
            out=out,
            executor=self.link.executor(),
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
        exec_body=lambda ns: ns.update(__module__="zen_mla.vllm"),
    )
    return cast("type[RemotePrefillBackend]", cls)
