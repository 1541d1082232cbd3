"""An MLA prefill backend for vLLM: vLLM's CPU prefill backend methods, computed by zen-mla.

    pip install zen-mla          # into vLLM's environment: the plugin below comes with it
    export ZEN_MLA_URL=http://cpu-node:8000     # by the service
    export ZEN_MLA_URL=local                    # or by zen-mla's kernels in vLLM's own process

`ZenMLARemotePrefillBackend` has the methods of vLLM's `CPUSDPAMLAPrefillBackend`
(`prepare_metadata`, `run_prefill_new_tokens`, `run_prefill_context_chunk`) and sends each call to
the service, or computes it in process. Where vLLM is importable the class subclasses vLLM's
`MLAPrefillBackend`; elsewhere it is `RemotePrefillBackend`, the same methods standing alone.
Importing this package imports neither vLLM nor anything of it.

    settings   RemoteSettings from ZEN_MLA_URL, ZEN_MLA_API_TOKEN, ZEN_MLA_FALLBACK; service_ready;
               LocalSettings from ZEN_MLA_URL=local, ZEN_MLA_KERNEL
    context    ContextKV, prefill_with_context: a step's new tokens and context chunks at once
    local      compute_here, LocalPrefiller: zen-mla's kernels in this process
    link       the way to the service per settings: up or down, local compute meanwhile
    stats      how many calls went to the service and how many were computed here
    backend    RemotePrefillBackend, backend_class (with vLLM's base where vLLM is importable)
    plugin     register(): the `vllm.general_plugins` entry point
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backend import BACKEND_NAME, VLLM_BASE, RemotePrefillBackend, backend_class
from .context import ContextKV, prefill_with_context
from .link import ServiceLink
from .local import LocalPrefiller
from .plugin import VLLM_REGISTRY, register
from .settings import (
    LocalSettings,
    RemoteSettings,
    Settings,
    default_settings,
    healthy,
    service_ready,
    settings_from_env,
)
from .stats import Stats, StatsSnapshot, stats

__all__ = [
    "BACKEND_NAME",
    "VLLM_BASE",
    "VLLM_REGISTRY",
    "ContextKV",
    "LocalPrefiller",
    "LocalSettings",
    "RemotePrefillBackend",
    "RemoteSettings",
    "ServiceLink",
    "Settings",
    "Stats",
    "StatsSnapshot",
    "ZenMLARemotePrefillBackend",
    "backend_class",
    "default_settings",
    "healthy",
    "prefill_with_context",
    "register",
    "service_ready",
    "settings_from_env",
    "stats",
]

if TYPE_CHECKING:
    ZenMLARemotePrefillBackend = RemotePrefillBackend
else:

    def __getattr__(name: str) -> object:
        if name == "ZenMLARemotePrefillBackend":
            return backend_class()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
