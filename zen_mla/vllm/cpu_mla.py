"""vLLM's CPU_MLA attention backend with the cached context attended from the latent
(`zen_mla.latent_attention`, in process or by the service), never expanded. Imports vLLM: the
plugin names it by path.

In vLLM (0.32), a prefill over cached context runs `MLACommonBaseImpl._compute_prefill_context`:
for each chunk of the context it gathers the latent rows `[kv_c | k_pe]` from the paged cache,
expands every one of them with `kv_b_proj` (`H (Dn + Dv)` values a token, 2 R a value of
multiply-adds), then hands the expanded keys and values to the prefill backend. `ZenCPUMLAImpl`
overrides that one method: the same gather into vLLM's workspace, then `latent_attention` on the
chunk's latent and the layer's `kv_b_proj` weight (cached once, in the model's dtype, at load;
`precision="bf16"`: the keys and values rounded to bf16 as vLLM's expansion rounds them),
the chunks folded by vLLM's own `init_mla_context_partial` and `accumulate_mla_context_chunk`,
and vLLM merges the result with the new tokens' part as before. Where zen-mla runs in vLLM's
process (`ZEN_MLA_URL=local`) the call is the library's; where it is a service, the same call
goes to it (`ServiceLink.prefill_latent`: the latent sent, the weight registered with the
service once per layer, computed here while the service is down). The new tokens' own
attention still goes to the prefill backend (zen-mla's, `backend.py`). A prefill of more than
`LATENT_MAX_QUERIES` new tokens has its context expanded as vLLM does (there the latent's blocks
cost more than the expanded context's bytes), and so does every prefill with `ZEN_MLA_LATENT`
off, read at each call. The plugin points CPU_MLA here on vLLM's CPU platform.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.model_executor.layers.attention.mla_attention import (
    accumulate_mla_context_chunk,
    init_mla_context_partial,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    get_and_maybe_dequant_weights,
)
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from ..attention.latent import latent_attention
from ..envs import ZEN_MLA_LATENT
from .link import ServiceLink
from .settings import LocalSettings, default_settings
from .stats import stats

__all__ = [
    "LATENT_MAX_QUERIES",
    "ZenCPUMLABackend",
    "ZenCPUMLAImpl",
    "latent_here",
    "weight_name",
]

#: a prefill's new tokens (the queries of its context chunks) up to which the context is
#: attended from the latent; past them vLLM expands it as it does. Measured on an AMD EPYC Zen 5
#: (2 vCPUs, 16 heads, a context chunk of 8k or 16k tokens, paired medians): the latent over
#: vLLM's bf16 expansion then zen-mla's kernel, 0.85-0.86 at 256 new tokens, 0.90-0.93 at 1024,
#: 0.96-0.98 at 2048, 1.03-1.09 at 4096, 1.11 at 8192 (one key block's expansion a call of
#: the native kernel over every query: past a few thousand queries, the blocks' merges cost
#: more than the expanded context's bytes)
LATENT_MAX_QUERIES = 2048

# what a weight's name may hold besides the digest (the service's alphabet, 128 characters)
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9._-]")
_DIGEST_CHARS = 32


def latent_here() -> bool:
    """Whether this process's CPU_MLA attends cached context from the latent now, in process or
    by the service as `ZEN_MLA_URL` says: `ZEN_MLA_LATENT` on; read at each call, as the prefill
    backend reads its settings (the plugin registers this class once, whatever they are then)."""
    return ZEN_MLA_LATENT.read()


def weight_name(layer: str, w_kv_b: torch.Tensor) -> str:
    """The name `w_kv_b` is registered under with the service: the layer's name (`kv_b_proj`'s
    prefix, its characters outside the service's alphabet as `_`, its end kept) then a digest
    of the weight's shape, dtype and bytes. The service keeps a weight per caller (a tenant, or
    a peer address), so the engines of one host sharing it (other models, other
    tensor-parallel ranks of this one) name the same layer alike and hold other weights under
    it: the digest keeps each its own, and gives an engine started again the names it
    registered before (the same weights replaced, none left beside them). Hashing 32 MiB (a
    DeepSeek-V3 layer's) takes ~16 ms on an AMD EPYC Zen 5, once a layer."""
    w = w_kv_b.detach().contiguous()
    digest = hashlib.sha256(f"{list(w.shape)} {w.dtype}".encode())
    digest.update(w.view(torch.uint8).numpy().data)  # the bytes as they lie, any dtype
    layer = _NOT_IN_NAMES.sub("_", layer or "kv_b_proj")
    return f"{layer[-(127 - _DIGEST_CHARS) :]}-{digest.hexdigest()[:_DIGEST_CHARS]}"


class ZenCPUMLAImpl(CPUMLAImpl):
    """CPU_MLA's implementation, its prefill context attended from the latent."""

    w_kv_b: torch.Tensor | None = None
    #: `w_kv_b`'s name with the service, and the link it was registered with (a new link,
    #: when the settings changed, is told again)
    _weight_name: str | None = None
    _registered_with: ServiceLink | None = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        # [H * (Dn + Dv), R], out x in: each head's k_nope rows, then its v rows
        self.w_kv_b = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=act_dtype)

    def _compute_prefill_context(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        k_scale: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not latent_here() or q.shape[0] > LATENT_MAX_QUERIES:
            return super()._compute_prefill_context(  # type: ignore[no-any-return]
                q, kv_c_and_k_pe_cache, attn_metadata, k_scale
            )
        prefill = attn_metadata.prefill
        assert prefill is not None and prefill.chunked_context is not None
        if self.w_kv_b is None or self.w_kv_b.dtype != q.dtype:
            # loaded without vLLM's weight pass (or q in another dtype): as vLLM would, and
            # registered with the service again under the name of what it is now
            self.w_kv_b = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=q.dtype)
            self._weight_name = self._registered_with = None
        settings = default_settings()
        link = None if isinstance(settings, LocalSettings) else ServiceLink.of(settings)
        chunked = prefill.chunked_context
        workspace = chunked.workspace  # [rows, R + P], the model's dtype
        rank = self.kv_lora_rank
        output = output_lse = None
        for chunk in chunked.chunks:
            toks = chunk.num_context_tokens
            ops.gather_mla_context_cache_cpu(
                src_cache=kv_c_and_k_pe_cache,
                dst=workspace[:toks],
                block_table=prefill.block_table[chunk.request_slice],
                starts=chunk.starts,
                cu_seq_lens=chunk.cu_seq_lens,
            )
            latent = workspace[:toks]
            out, lse = self._attend_latent(
                link,
                q[chunk.token_slice],
                latent[:, :rank],
                latent[:, rank:],
                chunk.query_start_loc,
                chunk.cu_seq_lens,
            )
            if output is None:
                if len(chunked.chunks) == 1 and not chunked.empty_token_slices:
                    return out, lse
                output, output_lse = init_mla_context_partial(
                    chunked, out, lse, num_tokens=q.shape[0]
                )
            assert output_lse is not None
            accumulate_mla_context_chunk(chunk, out, lse, output, output_lse)
        assert output is not None and output_lse is not None
        return output, output_lse

    def _attend_latent(
        self,
        link: ServiceLink | None,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        q_cu_seq_lens: torch.Tensor,
        kv_cu_seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One context chunk from its latent (`kv_c` `[Tk, R]`, `k_pe` `[Tk, P]`, rows of
        vLLM's workspace), non-causal, with its LSE: `latent_attention` here (`link` None),
        or the same call by the service through `link`, which computes it here while the
        service is down. Counted in `stats` (`latent`; `local` here, the link counts its own)."""
        assert self.w_kv_b is not None
        # vLLM's own numbers: k_nope and v rounded to the model's dtype, as its expansion
        # rounds them, and the LSE as that leaves it
        options: dict[str, Any] = dict(
            causal=False, return_lse=True, scale=self.scale, form="auto", precision="bf16"
        )
        if link is None:
            got = latent_attention(
                q, kv_c, k_pe, self.w_kv_b, q_cu_seq_lens, kv_cu_seq_lens, **options
            )
            stats.add(latent=1, local=1)
        else:
            got = link.prefill_latent(
                q, kv_c, k_pe, self._weight_at(link), q_cu_seq_lens, kv_cu_seq_lens, **options
            )
            stats.add(latent=1)
        out, lse = got
        return out, lse

    def _weight_at(self, link: ServiceLink) -> str:
        """`w_kv_b`'s name, the weight registered with `link` under it (once a link)."""
        assert self.w_kv_b is not None
        if self._weight_name is None:
            self._weight_name = weight_name(getattr(self.kv_b_proj, "prefix", ""), self.w_kv_b)
        if self._registered_with is not link:
            link.register_weight(self._weight_name, self.w_kv_b)
            self._registered_with = link
        return self._weight_name


class ZenCPUMLABackend(CPUMLABackend):
    """CPU_MLA, with `ZenCPUMLAImpl` as its implementation (its name, metadata, cache layout
    and builder are CPU_MLA's)."""

    @staticmethod
    def get_impl_cls() -> type[ZenCPUMLAImpl]:
        return ZenCPUMLAImpl
