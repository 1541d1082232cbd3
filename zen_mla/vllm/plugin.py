"""zen-mla as a vLLM general plugin: `register()`, the `vllm.general_plugins` entry point
`zen_mla`, which vLLM calls in every process (main, engine core, workers).

It does nothing unless `ZEN_MLA_URL` is set. When it is set (to the service's URL, or to `local`
for zen-mla's kernels in vLLM's own process), it registers the backend as vLLM's MLA prefill
backend `ZEN_MLA`, selected on GPU platforms with
`--attention-config '{"mla_prefill_backend": "ZEN_MLA"}'`. vLLM's CPU platform ignores
`mla_prefill_backend` and always takes the first available of its `ZEN_CPU` and `CPU` prefill
backends: there the plugin points both at zen-mla (vLLM's own registry overrides,
`register_mla_prefill_backend`), so nothing else needs setting.
"""

from __future__ import annotations

import importlib
import logging

from ..envs import ZEN_MLA_LATENT, ZEN_MLA_URL
from .backend import BACKEND_NAME
from .settings import LocalSettings, default_settings

__all__ = ["BACKEND_PATH", "CPU_MLA_PATH", "VLLM_REGISTRY", "register"]

logger = logging.getLogger("zen_mla.vllm")

VLLM_REGISTRY = "vllm.v1.attention.backends.mla.prefill.registry"
BACKEND_PATH = "zen_mla.vllm.ZenMLARemotePrefillBackend"
ATTENTION_REGISTRY = "vllm.v1.attention.backends.registry"
#: CPU_MLA with its cached context attended from the latent (in process or through the service)
CPU_MLA_PATH = "zen_mla.vllm.cpu_mla.ZenCPUMLABackend"
# what vLLM's CPU platform (vllm/platforms/cpu.py, get_mla_prefill_backend_cls) tries, in order
CPU_PREFILL_ENTRIES = ("ZEN_CPU", "CPU")


def register() -> None:
    """vLLM's MLA prefill to zen-mla when `ZEN_MLA_URL` is set (see the module); logs a line
    saying what it did. Safe to call again. Raises `zen_mla.InvalidInputError` for settings
    that cannot be read (a bad URL, an empty token), so a misconfiguration stops vLLM at start
    rather than running without the service."""
    if not ZEN_MLA_URL.is_set():
        logger.debug("zen-mla: ZEN_MLA_URL is not set; vLLM's MLA prefill is left as it is")
        return
    settings = default_settings()
    _log_with_vllm()
    registry = importlib.import_module(VLLM_REGISTRY)
    backends = registry.MLAPrefillBackendEnum
    if BACKEND_NAME in backends.__members__:
        registry.register_mla_prefill_backend(backends[BACKEND_NAME], BACKEND_PATH)
    else:
        registry.register_mla_prefill_backend(BACKEND_NAME, BACKEND_PATH)
    if isinstance(settings, LocalSettings):
        where = f"zen-mla's kernels in this process (ZEN_MLA_KERNEL={settings.kernel})"
    else:
        fallback = "computed here while it is down" if settings.fallback else "no fallback"
        where = f"the service {', '.join(settings.urls)} ({fallback})"
    platform = importlib.import_module("vllm.platforms").current_platform
    if not platform.is_cpu():
        logger.info(
            "zen-mla: registered MLA prefill backend %s (%s); select it with "
            '--attention-config \'{"mla_prefill_backend": "%s"}\'',
            BACKEND_NAME,
            where,
            BACKEND_NAME,
        )
        return
    for name in CPU_PREFILL_ENTRIES:
        registry.register_mla_prefill_backend(backends[name], BACKEND_PATH)
    logger.info(
        "zen-mla: vLLM's MLA prefill goes to %s: CPU platform prefill backends %s now point at %s",
        where,
        " and ".join(CPU_PREFILL_ENTRIES),
        BACKEND_PATH,
    )
    # CPU_MLA's context from the latent while `ZEN_MLA_LATENT` is on (`cpu_mla.latent_here`,
    # read at each call: vLLM loads plugins once a process, settings may change after)
    attention = importlib.import_module(ATTENTION_REGISTRY)
    attention.register_backend(attention.AttentionBackendEnum.CPU_MLA, CPU_MLA_PATH)
    if ZEN_MLA_LATENT.read():
        logger.info(
            "zen-mla: CPU_MLA's cached context is attended from the latent %s (%s): vLLM no "
            "longer expands it with kv_b_proj",
            "in this process" if isinstance(settings, LocalSettings) else "by the service",
            CPU_MLA_PATH,
        )
    if _amx():
        logger.warning(
            "zen-mla: this CPU has AMX, where vLLM picks the AMX_MLA attention backend, whose "
            "prefill calls no prefill backend: zen-mla is not used unless vLLM runs with "
            "--attention-backend CPU_MLA (measured on a Xeon with AMX: CPU_MLA with zen-mla in "
            "process gave the first token of 2k-16k-token prompts 1.5-1.95x sooner than AMX_MLA, "
            "CPU_MLA's own prefill 2.2-4.2x later; docs/vllm.md)"
        )
    else:
        logger.info(
            "zen-mla: vLLM's CPU_MLA attention backend runs here, and its prefill is zen-mla's; "
            "on one host zen-mla in process (ZEN_MLA_URL=local) and the service on the same "
            "cores gave the first token within 0.87-1.05x of each other (measured on a Xeon, "
            "2k-16k-token prompts; docs/vllm.md)"
        )


class _ToVllm(logging.Handler):
    """Hands zen-mla's records to vLLM's logger tree, whose handlers vLLM sets up (and may set
    up again) after plugins load: looked up at each record, not copied once."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm.zen_mla").handle(record)


def _log_with_vllm() -> None:
    """zen-mla's log lines (this one, outages, probes) where vLLM's go, at vLLM's level: vLLM
    configures only its own logger tree ("vllm"), where a library logger's INFO lines would be
    dropped and its warnings printed bare."""
    ours = logging.getLogger("zen_mla")
    if any(isinstance(h, _ToVllm) for h in ours.handlers):
        return
    ours.addHandler(_ToVllm())
    ours.setLevel(logging.DEBUG)  # vLLM's handlers filter by their own level
    ours.propagate = False


def _amx() -> bool:
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False
