"""A tiny DeepSeek-V2-style model on disk, random weights, no tokenizer (the engine runs with
skip_tokenizer_init and prompt token ids): what vLLM needs to run MLA without a download.

vLLM's CPU MLA takes kv_lora_rank 512 and qk_rope_head_dim 64 only; the rest is small: two
dense layers, hidden 256, 4 heads, qk_nope 32, v 32, vocab 512.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,  # every layer dense: no experts to build
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def write_tiny_deepseek(path: Path, seed: int = 0) -> Path:
    """config.json and model.safetensors (fp32) in `path`; returns `path`."""
    c = CONFIG
    h, heads, v_vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    nope, rope, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    rank, inter = c["kv_lora_rank"], c["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    tensors = {
        "model.embed_tokens.weight": w(v_vocab, h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": w(v_vocab, h),
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
    save_file({k: t.contiguous() for k, t in tensors.items()}, path / "model.safetensors")
    return path
