"""zen_mla.vllm without a server: settings, availability, the lazy vLLM base, refusals that
happen before any request is sent. Round trips are in tests/service/test_vllm_backend.py."""

from __future__ import annotations

import abc
import socket
import subprocess
import sys
import types

import pytest
import torch

import zen_mla
from zen_mla import vllm
from zen_mla.vllm import RemotePrefillBackend, RemoteSettings


def backend(settings: RemoteSettings, num_heads: int = 4, scale: float = 0.25):
    return vllm.backend_class()(num_heads, scale, 16, 16, 0, 16, None, settings=settings)


@pytest.fixture
def nowhere() -> RemoteSettings:
    """Settings pointing at a loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return RemoteSettings(urls=(f"http://127.0.0.1:{port}",), health_timeout_s=1.0)


@pytest.mark.slow  # a fresh interpreter importing torch: 1.5-3.5 s here
def test_importing_the_module_imports_no_vllm():
    code = "import sys, zen_mla.vllm; print(any(m.split('.')[0] == 'vllm' for m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("env", "urls", "token"),
    [
        ({}, ("http://127.0.0.1:8000",), None),
        ({"ZEN_MLA_URL": "http://a:1"}, ("http://a:1",), None),
        ({"ZEN_MLA_URL": "http://a:1, https://b:2,"}, ("http://a:1", "https://b:2"), None),
        ({"ZEN_MLA_API_TOKEN": "s3cret"}, ("http://127.0.0.1:8000",), "s3cret"),
    ],
    ids=["defaults", "one_url", "several_urls", "token"],
)
def test_settings_from_the_environment(env, urls, token):
    assert RemoteSettings.from_env(env) == RemoteSettings(urls=urls, token=token)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"ZEN_MLA_API_TOKEN": ""}, "ZEN_MLA_API_TOKEN: expected a non-empty token"),
        ({"ZEN_MLA_API_TOKEN": "  "}, "ZEN_MLA_API_TOKEN: expected a non-empty token"),
        ({"ZEN_MLA_URL": "127.0.0.1:8000"}, "ZEN_MLA_URL: expected http://host:port"),
        ({"ZEN_MLA_URL": " , "}, "ZEN_MLA_URL: expected one http"),
    ],
    ids=["empty_token", "blank_token", "no_scheme", "no_url"],
)
def test_bad_settings_are_refused(env, match):
    with pytest.raises(zen_mla.InvalidInputError, match=match):
        RemoteSettings.from_env(env)


def test_is_available_is_false_when_nothing_answers_and_decided_once(monkeypatch, nowhere):
    monkeypatch.setenv("ZEN_MLA_URL", nowhere.urls[0])
    vllm.default_settings.cache_clear()
    vllm.service_ready.cache_clear()
    try:
        assert RemotePrefillBackend.is_available() is False
        assert vllm.service_ready.cache_info().misses == 1
        assert RemotePrefillBackend.is_available() is False
        assert vllm.service_ready.cache_info().hits == 1
    finally:
        vllm.default_settings.cache_clear()
        vllm.service_ready.cache_clear()


def test_is_available_never_raises_on_bad_settings(monkeypatch):
    monkeypatch.setenv("ZEN_MLA_API_TOKEN", "")
    vllm.default_settings.cache_clear()
    try:
        assert RemotePrefillBackend.is_available() is False
    finally:
        vllm.default_settings.cache_clear()


def test_names_and_capabilities(nowhere):
    b = backend(nowhere)
    assert b.get_name() == "ZEN_MLA_REMOTE" and b.supports_out()
    assert b.supports_dtype(torch.bfloat16) and not b.supports_dtype(torch.int8)
    assert (b.num_heads, b.scale, b.v_head_dim) == (4, 0.25, 16)


def test_backends_of_one_settings_share_a_client(nowhere):
    assert backend(nowhere).client is backend(nowhere).client


def _qkv(t=6, h=4, d=16):
    return (torch.randn(t, h, d, dtype=torch.bfloat16) for _ in range(3))


class _Meta:
    query_start_loc = torch.tensor([0, 3, 6], dtype=torch.int32)


def test_output_scale_is_refused(nowhere):
    b = backend(nowhere)
    b.prepare_metadata(_Meta())
    with pytest.raises(zen_mla.InvalidInputError, match="output_scale: expected None"):
        b.run_prefill_new_tokens(*_qkv(), False, output_scale=torch.tensor(1.0))


def test_running_before_prepare_metadata_is_refused(nowhere):
    with pytest.raises(zen_mla.InvalidInputError, match="prepare_metadata"):
        backend(nowhere).run_prefill_new_tokens(*_qkv(), False)


@pytest.mark.parametrize(
    "out",
    [torch.empty(6, 4, 8, dtype=torch.bfloat16), torch.empty(6, 4, 16, dtype=torch.float32)],
    ids=["shape", "dtype"],
)
def test_an_out_that_does_not_fit_is_refused(nowhere, out):
    b = backend(nowhere)
    b.prepare_metadata(_Meta())
    with pytest.raises(zen_mla.InvalidInputError, match=r"out: expected \[6, 4, 16\] bfloat16"):
        b.run_prefill_new_tokens(*_qkv(), False, out=out)


def test_an_unreachable_service_is_an_error_not_numbers(nowhere):
    b = backend(RemoteSettings(urls=nowhere.urls))
    b.prepare_metadata(_Meta())
    with pytest.raises(zen_mla.ServiceUnavailableError, match="unreachable"):
        b.run_prefill_new_tokens(*_qkv(), True)


@pytest.fixture
def vllm_base(monkeypatch):
    """A stand-in for vLLM's `MLAPrefillBackend` (vLLM does not install here): an ABC with the
    abstract methods vLLM's has."""

    class MLAPrefillBackend(abc.ABC):
        @staticmethod
        @abc.abstractmethod
        def get_name() -> str: ...

        @abc.abstractmethod
        def run_prefill_new_tokens(self, q, k, v, return_softmax_lse): ...

        @abc.abstractmethod
        def run_prefill_context_chunk(self, chunk, q, k, v): ...

    names = ["vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"]
    names += ["vllm.v1.attention.backends.mla", "vllm.v1.attention.backends.mla.prefill"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    base = types.ModuleType(vllm.VLLM_BASE)
    base.MLAPrefillBackend = MLAPrefillBackend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm.VLLM_BASE, base)
    vllm.backend_class.cache_clear()
    yield MLAPrefillBackend
    vllm.backend_class.cache_clear()


def test_where_vllm_is_importable_the_backend_subclasses_its_base(vllm_base, nowhere):
    cls = vllm.ZenMLARemotePrefillBackend
    assert issubclass(cls, vllm_base) and issubclass(cls, RemotePrefillBackend)
    assert cls.__module__ == "zen_mla.vllm" and cls.__name__ == "ZenMLARemotePrefillBackend"
    b = backend(nowhere)  # instantiable: every abstract method is ours
    assert isinstance(b, vllm_base) and b.get_name() == "ZEN_MLA_REMOTE"


def test_elsewhere_it_stands_alone():
    vllm.backend_class.cache_clear()
    assert vllm.ZenMLARemotePrefillBackend is RemotePrefillBackend
    assert RemotePrefillBackend.__mro__ == (RemotePrefillBackend, object)


def test_register_names_the_class_as_vllms_custom_prefill_backend(monkeypatch):
    """Against a stand-in of vLLM's registry module: what `register()` hands it, and that the
    path it hands resolves (vLLM resolves it with import_module + getattr)."""
    calls = []
    registry = types.ModuleType(vllm.VLLM_REGISTRY)
    registry.MLAPrefillBackendEnum = types.SimpleNamespace(CUSTOM="CUSTOM")  # type: ignore[attr-defined]
    registry.register_mla_prefill_backend = lambda *args: calls.append(args)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm.VLLM_REGISTRY, registry)
    vllm.register()
    assert calls == [("CUSTOM", "zen_mla.vllm.ZenMLARemotePrefillBackend")]
    module, _, name = calls[0][1].rpartition(".")
    assert getattr(sys.modules[module], name) is vllm.backend_class()
