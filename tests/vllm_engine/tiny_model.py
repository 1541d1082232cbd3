"""A tiny DeepSeek-V2-style model on disk, random weights, no tokenizer (the engine runs with
skip_tokenizer_init and prompt token ids), written by bench/_deepseek.py: two dense layers,
hidden 256, 4 heads, qk_nope 32 (+ rope 64), v 32, kv_lora_rank 512, vocab 512, fp32.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# loaded from its file: bench/ on sys.path would shadow names (kernel, pool) for every test
_spec = importlib.util.spec_from_file_location(
    "bench_deepseek", Path(__file__).resolve().parents[2] / "bench" / "_deepseek.py"
)
assert _spec is not None and _spec.loader is not None
_deepseek = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_deepseek)

CONFIG = _deepseek.config(
    heads=4,
    layers=2,
    hidden=256,
    intermediate=512,
    qk_nope=32,
    v_head_dim=32,
    vocab=512,
    max_positions=1024,
    dtype="float32",
)


def write_tiny_deepseek(path: Path, seed: int = 0) -> Path:
    """config.json and model.safetensors (fp32) in `path`; returns `path`."""
    return _deepseek.write_deepseek(path, CONFIG, seed)
