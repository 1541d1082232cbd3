"""A DeepSeek-V2-style model on disk with random weights and no tokenizer (vLLM runs it with
skip_tokenizer_init and prompt token ids): what vLLM needs to run MLA without a download. Every
layer dense (`first_k_dense_replace` = layers): no experts to build. vLLM's CPU MLA takes
kv_lora_rank 512 and qk_rope_head_dim 64 only.

    write_deepseek(path, config(heads=16, layers=2))     # DeepSeek-V2-Lite's attention dims
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["config", "write_deepseek"]


def config(
    heads: int = 16,
    layers: int = 2,
    hidden: int = 2048,
    intermediate: int = 1408,
    qk_nope: int = 128,
    v_head_dim: int = 128,
    vocab: int = 1024,
    max_positions: int = 32768,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """A config.json: DeepSeek-V2-Lite's attention (16 heads, qk 128 + 64, v 128, kv_lora_rank
    512, hidden 2048) by default, its small dense MLP (1408), a small vocabulary."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "moe_intermediate_size": 64,
        "num_hidden_layers": layers,
        "first_k_dense_replace": layers,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": qk_nope,
        "qk_rope_head_dim": 64,
        "v_head_dim": v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": dtype,
    }


def write_deepseek(path: Path, c: dict[str, Any], seed: int = 0) -> Path:
    """config.json and model.safetensors (in `c["torch_dtype"]`) in `path`; returns `path`."""
    h, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    nope, rope, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    rank, inter = c["kv_lora_rank"], c["intermediate_size"]
    dtype = getattr(torch, c["torch_dtype"])
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    tensors = {
        "model.embed_tokens.weight": w(vocab, h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": w(vocab, h),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": w(heads * (nope + rope), h),
            p + "self_attn.kv_a_proj_with_mqa.weight": w(rank + rope, h),
            p + "self_attn.kv_a_layernorm.weight": torch.ones(rank),
            p + "self_attn.kv_b_proj.weight": w(heads * (nope + dv), rank),
            p + "self_attn.o_proj.weight": w(h, heads * dv),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(c, indent=2))
    save_file({k: t.to(dtype).contiguous() for k, t in tensors.items()}, path / "model.safetensors")
    return path
