"""The real-vLLM tier (scripts/test-vllm runs it in .venv-vllm): vLLM's own engine on a tiny
DeepSeek-V2-style model, its MLA prefill sent to a real zen-mla server by the plugin. Where vLLM
is not importable (the main suite's .venv) nothing here is collected.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that a test sees every
prefill call; set before vLLM is imported."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the model needs far less


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm_engine.tiny_model import write_tiny_deepseek

    return write_tiny_deepseek(tmp_path_factory.mktemp("model"))


@pytest.fixture
def zen_mla_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A free loopback URL, as ZEN_MLA_URL (read again by the next engine's backends)."""
    from tests.service.servers import free_port
    from zen_mla import vllm

    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("ZEN_MLA_URL", url)
    vllm.default_settings.cache_clear()
    yield url
    vllm.default_settings.cache_clear()
