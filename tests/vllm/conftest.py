"""What the tests of zen_mla.vllm share: stand-ins of vLLM's prefill registry and platform."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from zen_mla import vllm


@pytest.fixture
def vllm_registry(monkeypatch):
    """Stand-ins of vLLM's prefill registry (an enum with its CPU entries, and
    `register_mla_prefill_backend` recording what it was handed), of its attention backends'
    registry (`register_backend`, recorded in `attention`) and of `vllm.platforms`. The plugin
    in real vLLM: tests/vllm_engine/."""
    calls: list[tuple[object, str]] = []
    attention: list[tuple[object, str]] = []
    members = {"CPU": "CPU", "ZEN_CPU": "ZEN_CPU", "FLASH_ATTN": "FLASH_ATTN"}

    class Backends:
        __members__ = members

        def __class_getitem__(cls, name):
            return members[name]

    def register_mla_prefill_backend(backend, class_path):
        if isinstance(backend, str) and backend not in members.values():
            members[backend] = backend
        calls.append((backend, class_path))

    registry = types.ModuleType(vllm.VLLM_REGISTRY)
    registry.MLAPrefillBackendEnum = Backends  # type: ignore[attr-defined]
    registry.register_mla_prefill_backend = register_mla_prefill_backend  # type: ignore[attr-defined]
    platform = types.SimpleNamespace(cpu=True)
    platform.is_cpu = lambda: platform.cpu
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = platform  # type: ignore[attr-defined]
    backends = types.ModuleType(vllm.plugin.ATTENTION_REGISTRY)
    backends.AttentionBackendEnum = types.SimpleNamespace(CPU_MLA="CPU_MLA")  # type: ignore[attr-defined]
    backends.register_backend = lambda b, path: attention.append((b, path))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm.plugin.ATTENTION_REGISTRY, backends)
    monkeypatch.setitem(sys.modules, vllm.VLLM_REGISTRY, registry)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    ours = logging.getLogger("zen_mla")  # the plugin hands zen-mla's lines to vLLM's loggers
    kept = (list(ours.handlers), ours.level, ours.propagate)
    vllm.default_settings.cache_clear()
    yield types.SimpleNamespace(calls=calls, attention=attention, platform=platform)
    vllm.default_settings.cache_clear()
    ours.handlers[:], ours.level, ours.propagate = kept
