"""vLLM's CPU_MLA attention backend with the cached context attended from the latent
(`zen_mla.latent_attention`), never expanded. Imports vLLM: the plugin names it by path.

In vLLM (0.32), a prefill over cached context runs `MLACommonBaseImpl._compute_prefill_context`:
for each chunk of the context it gathers the latent rows `[kv_c | k_pe]` from the paged cache,
expands every one of them with `kv_b_proj` (`H (Dn + Dv)` values a token, 2 R a value of
multiply-adds), then hands the expanded keys and values to the prefill backend. `ZenCPUMLAImpl`
overrides that one method: the same gather into vLLM's workspace, then `latent_attention` on the
chunk's latent and the layer's `kv_b_proj` weight (cached once, in the model's dtype, at load;
`precision="bf16"`: the keys and values rounded to bf16 as vLLM's expansion rounds them),
the chunks folded by vLLM's own `init_mla_context_partial` and `accumulate_mla_context_chunk`,
and vLLM merges the result with the new tokens' part as before. The new tokens' own attention
still goes to the prefill backend (zen-mla's, `backend.py`). A prefill of more than
`LATENT_MAX_QUERIES` new tokens has its context expanded as vLLM does (there the latent's
blocks cost more than the expanded context's bytes). The plugin points CPU_MLA here on vLLM's
CPU platform; the latent is taken where zen-mla runs in vLLM's process (`ZEN_MLA_URL=local`)
and `ZEN_MLA_LATENT` is on, read at each call (elsewhere it is CPU_MLA as vLLM ships it).
"""

from __future__ import annotations

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
from .settings import LocalSettings, default_settings
from .stats import stats

__all__ = ["LATENT_MAX_QUERIES", "ZenCPUMLABackend", "ZenCPUMLAImpl", "latent_here"]

#: a prefill's new tokens (the queries of its context chunks) up to which the context is
#: attended from the latent; past them vLLM expands it as it does. Measured on an AMD EPYC Zen 5
#: (2 vCPUs, 16 heads, a context chunk of 8k or 16k tokens, paired medians): the latent over
#: vLLM's bf16 expansion then zen-mla's kernel, 0.85-0.86 at 256 new tokens, 0.90-0.93 at 1024,
#: 0.96-0.98 at 2048, 1.03-1.09 at 4096, 1.11 at 8192 (one key block's expansion a call of
#: the native kernel over every query: past a few thousand queries, the blocks' merges cost
#: more than the expanded context's bytes)
LATENT_MAX_QUERIES = 2048


def latent_here() -> bool:
    """Whether this process attends cached context from the latent now: zen-mla runs in it
    (`ZEN_MLA_URL=local`) and `ZEN_MLA_LATENT` is on; read at each call, as the prefill backend
    reads its settings (the plugin registers this class once, whatever they are then)."""
    return isinstance(default_settings(), LocalSettings) and ZEN_MLA_LATENT.read()


class ZenCPUMLAImpl(CPUMLAImpl):
    """CPU_MLA's implementation, its prefill context attended from the latent."""

    w_kv_b: torch.Tensor | None = None

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
        if self.w_kv_b is None:  # loaded without vLLM's weight pass: as vLLM would
            self.w_kv_b = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=q.dtype)
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
            out, lse = latent_attention(
                q[chunk.token_slice],
                latent[:, :rank],
                latent[:, rank:],
                self.w_kv_b.to(q.dtype),
                chunk.query_start_loc,
                chunk.cu_seq_lens,
                causal=False,
                return_lse=True,
                scale=self.scale,
                # vLLM's own numbers: k_nope and v rounded to the model's dtype, as its
                # expansion rounds them, and the LSE as that leaves it
                precision="bf16",
            )
            stats.add(latent=1)
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


class ZenCPUMLABackend(CPUMLABackend):
    """CPU_MLA, with `ZenCPUMLAImpl` as its implementation (its name, metadata, cache layout
    and builder are CPU_MLA's)."""

    @staticmethod
    def get_impl_cls() -> type[ZenCPUMLAImpl]:
        return ZenCPUMLAImpl
