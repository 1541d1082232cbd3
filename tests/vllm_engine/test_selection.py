"""How a GPU platform's user selects zen-mla by name, with real vLLM (the GPU itself cannot be
had here): the plugin's ZEN_MLA entry parses from the CLI and from Python, resolves to the
backend, and passes the checks vLLM's selector makes before it honours `mla_prefill_backend`
(selector.py, the branch for platforms other than CPU). And on vLLM's CPU platform, the attention
backend that calls a prefill backend at all: CPU_MLA, named, also where the CPU has AMX."""

from __future__ import annotations

import pytest
import torch
from vllm.config import AttentionConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.plugins import load_general_plugins
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.attention.backends.mla.prefill.base import MLADimensions
from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
from vllm.v1.attention.backends.mla.prefill.selector import MLAPrefillSelectorConfig

import zen_mla.vllm as zen_vllm

SELECTION = '{"mla_prefill_backend": "ZEN_MLA"}'


@pytest.fixture(autouse=True)
def plugin(zen_mla_url):
    load_general_plugins()  # once per process, as vLLM does
    zen_vllm.register()  # with this test's ZEN_MLA_URL (safe to call again)


def test_the_cli_selects_it_by_name(tiny_model):
    """`vllm serve MODEL --attention-config '{"mla_prefill_backend": "ZEN_MLA"}'`"""
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(tiny_model), "--attention-config", SELECTION])
    config = AsyncEngineArgs.from_cli_args(args).attention_config
    assert config.mla_prefill_backend is MLAPrefillBackendEnum["ZEN_MLA"]


def test_python_selects_it_by_name_once_plugins_are_loaded():
    """`LLM(..., attention_config={"mla_prefill_backend": "ZEN_MLA"})` builds the config before
    vLLM loads plugins: `vllm.plugins.load_general_plugins()` first (the fixture does)."""
    config = AttentionConfig(mla_prefill_backend="ZEN_MLA")
    assert config.mla_prefill_backend.get_class() is zen_vllm.backend_class()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_it_passes_the_selectors_checks(dtype):
    cls = MLAPrefillBackendEnum["ZEN_MLA"].get_class()
    dims = MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert cls.validate_configuration(None, MLAPrefillSelectorConfig(dtype, dims)) == []
    assert cls.get_name() == "ZEN_MLA" and cls.is_available() is True


@pytest.mark.parametrize("amx", [False, True], ids=["no_amx", "amx"])
def test_on_cpu_naming_cpu_mla_gets_it_with_or_without_amx(monkeypatch, amx):
    """What test_engine.py's engines (and docs/vllm.md's advice to AMX hosts) rely on: vLLM's CPU
    platform takes the named CPU_MLA backend, whose prefill calls a prefill backend, over the
    AMX_MLA it would pick on a CPU with AMX (stood in for here); unnamed, it picks AMX_MLA there
    and CPU_MLA elsewhere."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    mla = AttentionSelectorConfig(
        head_size=576, dtype=torch.float32, kv_cache_dtype=None, block_size=None, use_mla=True
    )
    named = AttentionConfig(backend="CPU_MLA").backend
    assert named is AttentionBackendEnum.CPU_MLA
    cpu_mla, amx_mla = AttentionBackendEnum.CPU_MLA, AttentionBackendEnum.AMX_MLA
    assert CpuPlatform.get_attn_backend_cls(named, mla) == cpu_mla.get_path()
    unnamed = CpuPlatform.get_attn_backend_cls(None, mla)  # type: ignore[arg-type]
    assert unnamed == (amx_mla if amx else cpu_mla).get_path()
