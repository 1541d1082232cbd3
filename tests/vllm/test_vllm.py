"""zen_mla.vllm without a server: settings, availability, the lazy vLLM base, the plugin against
a stand-in of vLLM's registry, refusals that happen before any request is sent, the local
computation while nothing answers. Round trips and outages of a real server are in
tests/service/test_vllm_backend.py; real vLLM in tests/vllm_engine/ (scripts/test-vllm)."""

from __future__ import annotations

import abc
import http.server
import json
import logging
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator

import pytest
import torch

import zen_mla
from zen_mla import vllm
from zen_mla.vllm import RemotePrefillBackend, RemoteSettings
from zen_mla.vllm import context as vllm_context


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
    ("value", "fallback"),
    [("0", False), ("false", False), ("OFF", False), ("1", True), ("yes", True), (" on ", True)],
)
def test_the_fallback_setting(value, fallback):
    assert RemoteSettings.from_env({"ZEN_MLA_FALLBACK": value}).fallback is fallback
    assert RemoteSettings.from_env({}).fallback is True


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"ZEN_MLA_API_TOKEN": ""}, "ZEN_MLA_API_TOKEN: expected a non-empty token"),
        ({"ZEN_MLA_API_TOKEN": "  "}, "ZEN_MLA_API_TOKEN: expected a non-empty token"),
        ({"ZEN_MLA_URL": "127.0.0.1:8000"}, "ZEN_MLA_URL: expected http://host:port"),
        ({"ZEN_MLA_URL": " , "}, "ZEN_MLA_URL: expected one http"),
        ({"ZEN_MLA_FALLBACK": "maybe"}, "ZEN_MLA_FALLBACK: expected 1 or 0"),
    ],
    ids=["empty_token", "blank_token", "no_scheme", "no_url", "fallback"],
)
def test_bad_settings_are_refused(env, match):
    with pytest.raises(zen_mla.InvalidInputError, match=match):
        RemoteSettings.from_env(env)


BAD_URLS = {
    "no_host": ("http://", "names no host"),
    "port_only": ("http://:8000", "names no host"),
    "userinfo_only": ("https://user@", "names no host"),
    "space": ("http://a b", "a space or a control character"),
    "tab": ("http://a\tb:8000", "a space or a control character"),
    "port_not_a_number": ("http://[::1]:notaport", "port must be a number from 1 to 65535"),
    "port_empty": ("http://cpu-node:", "port must be a number from 1 to 65535"),
    "port_zero": ("http://cpu-node:0", "port must be a number from 1 to 65535"),
    "port_too_large": ("http://cpu-node:65536", "port must be a number from 1 to 65535"),
    "port_signed": ("http://cpu-node:+80", "port must be a number from 1 to 65535"),
    "port_not_ascii": ("http://cpu-node:\u0663", "port must be a number from 1 to 65535"),
    "ipv6_unclosed": ("http://[::1:8000", "host is not readable"),
    "ipv6_empty": ("http://[]:8000", "host is not readable"),
    "scheme": ("ftp://cpu-node:8000", "scheme must be http:// or https://"),
}


@pytest.mark.parametrize(("url", "why"), BAD_URLS.values(), ids=BAD_URLS.keys())
def test_a_url_no_call_could_use_is_refused_at_start(url, why):
    """Refused where the settings are read, naming the variable, rather than every call falling
    back in silence (or httpx raising its own InvalidURL at the first call)."""
    with pytest.raises(zen_mla.InvalidInputError, match=r"^ZEN_MLA_URL: expected http") as e:
        RemoteSettings.from_env({"ZEN_MLA_URL": url})
    assert why in str(e.value) and repr(url) in str(e.value)
    with pytest.raises(zen_mla.InvalidInputError, match=r"^ZEN_MLA_URL: "):
        RemoteSettings.from_env({"ZEN_MLA_URL": f"http://fine:1,{url}"})  # any of several


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "https://cpu-node",
        "http://[::1]:8000",
        "http://[::1]",
        "http://cpu-node:8000/zen-mla/",
        "https://user@cpu-node:65535",
        "http://localhost:1",
    ],
)
def test_urls_that_are_accepted(url):
    assert RemoteSettings.from_env({"ZEN_MLA_URL": url}).urls == (url,)


@pytest.fixture
def fresh_settings() -> Iterator[None]:
    vllm.default_settings.cache_clear()
    vllm.service_ready.cache_clear()
    yield
    vllm.default_settings.cache_clear()
    vllm.service_ready.cache_clear()


def test_with_the_fallback_it_is_always_available(monkeypatch, nowhere, fresh_settings):
    monkeypatch.setenv("ZEN_MLA_URL", nowhere.urls[0])
    assert RemotePrefillBackend.is_available() is True
    assert vllm.service_ready.cache_info().misses == 0  # nothing asked: the link's business


def test_without_it_is_available_is_false_when_nothing_answers_and_decided_once(
    monkeypatch, nowhere
):
    monkeypatch.setenv("ZEN_MLA_URL", nowhere.urls[0])
    monkeypatch.setenv("ZEN_MLA_FALLBACK", "0")
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
    assert b.get_name() == "ZEN_MLA" and b.supports_out()
    assert b.supports_dtype(torch.bfloat16) and not b.supports_dtype(torch.int8)
    assert (b.num_heads, b.scale, b.v_head_dim) == (4, 0.25, 16)


def test_backends_of_one_settings_share_a_client(nowhere):
    assert backend(nowhere).client is backend(nowhere).client


def test_a_clone_keeps_its_settings(nowhere):
    """vLLM runs only clones (one per metadata builder), built from the arguments it knows."""
    settings = RemoteSettings(urls=nowhere.urls, fallback=False, request_timeout_s=7.0)
    b = backend(settings)
    c = b.clone()
    assert type(c) is type(b) and c is not b
    assert c.settings is settings and c.link is b.link
    assert (c.num_heads, c.scale, c.v_head_dim, c.kv_lora_rank) == (4, 0.25, 16, 16)


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


def test_without_the_fallback_an_unreachable_service_is_an_error_not_numbers(nowhere):
    b = backend(RemoteSettings(urls=nowhere.urls, fallback=False))
    b.prepare_metadata(_Meta())
    with pytest.raises(zen_mla.ServiceUnavailableError, match="unreachable"):
        b.run_prefill_new_tokens(*_qkv(), True)


def test_with_it_an_unreachable_service_is_computed_here(nowhere, caplog):
    """The same numbers ragged_attention gives, the call counted, one warning for the outage."""
    settings = RemoteSettings(urls=nowhere.urls, probe_interval_s=60.0, probe_max_interval_s=60.0)
    b = backend(settings)
    b.prepare_metadata(_Meta())
    q, k, v = _qkv()
    before = vllm.stats.snapshot()
    with caplog.at_level(logging.INFO, logger="zen_mla.vllm"):
        out, lse = b.run_prefill_new_tokens(q, k, v, True)
        again = b.run_prefill_new_tokens(q, k, v, False)
    want_out, want_lse = zen_mla.ragged_attention(
        q, k, v, _Meta.query_start_loc, return_lse=True, scale=0.25
    )
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and torch.equal(again, out)
    after = vllm.stats.snapshot()
    assert (after.local - before.local, after.remote - before.remote) == (2, 0)
    assert after.outages - before.outages == 1 and not b.link.up
    outages = [r for r in caplog.records if "gave no answer" in r.getMessage()]
    assert len(outages) == 1 and outages[0].levelno == logging.WARNING
    assert "computing MLA prefill in this process" in outages[0].getMessage()


def test_computed_here_the_result_is_written_into_out(nowhere):
    b = backend(RemoteSettings(urls=nowhere.urls, probe_interval_s=60.0, probe_max_interval_s=60.0))
    b.prepare_metadata(_Meta())
    q, k, v = _qkv()
    out = torch.full((6, 4, 16), float("nan"), dtype=torch.bfloat16)
    got, lse = b.run_prefill_new_tokens(q, k, v, True, out=out)
    want_out, want_lse = zen_mla.ragged_attention(
        q, k, v, _Meta.query_start_loc, return_lse=True, scale=0.25
    )
    assert got is out and torch.equal(out, want_out) and torch.equal(lse, want_lse)
    out.fill_(float("nan"))
    assert b.run_prefill_new_tokens(q, k, v, False, out=out) is out
    assert torch.equal(out, want_out)


def test_a_context_chunk_is_computed_here_too(nowhere):
    b = backend(RemoteSettings(urls=nowhere.urls, probe_interval_s=60.0, probe_max_interval_s=60.0))
    b.prepare_metadata(_Meta())
    q = torch.randn(5, 4, 16, dtype=torch.float32)
    k, v = (torch.randn(7, 4, 16, dtype=torch.float32) for _ in range(2))
    chunk = types.SimpleNamespace(
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        cu_seq_lens=torch.tensor([0, 3, 7], dtype=torch.int32),
    )
    out, lse = b.run_prefill_context_chunk(chunk, q, k, v)
    want_out, want_lse = zen_mla.ragged_attention(
        q, k, v, chunk.query_start_loc, chunk.cu_seq_lens, causal=False, return_lse=True, scale=0.25
    )
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize(
    ("out", "lse", "match"),
    [
        (torch.zeros(6, 4, 16), None, r"out \[6, 4, 16\] float32, expected \[6, 4, 16\] bfloat16"),
        (torch.zeros(6, 4, 8, dtype=torch.bfloat16), None, r"out \[6, 4, 8\] bfloat16"),
        (
            torch.zeros(6, 4, 16, dtype=torch.bfloat16),
            torch.zeros(4, 6, dtype=torch.bfloat16),
            r"lse \[4, 6\] bfloat16, expected \[4, 6\] float32",
        ),
    ],
    ids=["out_dtype", "out_shape", "lse_dtype"],
)
def test_an_answer_of_the_wrong_shape_or_dtype_is_an_error(out, lse, match):
    q, _k, v = _qkv()
    with pytest.raises(zen_mla.KernelError, match=match):
        vllm_context.check_result(out, lse, q, v)


@pytest.fixture
def health_says() -> Iterator[Callable[[object], RemoteSettings]]:
    """A loopback HTTP server whose /health answers the JSON it is given, and every POST 503."""
    answer: list[object] = [None]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answer[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # a service that is draining: every prefill a 503
            body = json.dumps(
                {"type": "about:blank", "title": "Service Unavailable", "status": 503}
            ).encode()
            self.send_response(503)
            self.send_header("Content-Type", "application/problem+json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()

    def say(value: object) -> RemoteSettings:
        answer[0] = value
        return RemoteSettings(urls=(f"http://127.0.0.1:{httpd.server_address[1]}",))

    yield say
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("health", [[], "ok", 3, None, {"status": "draining"}, {}])
def test_service_ready_is_false_for_any_health_but_ok_and_never_raises(health_says, health):
    vllm.service_ready.cache_clear()
    try:
        assert vllm.service_ready(health_says(health)) is False
        assert vllm.healthy(health_says({"status": "ok"})) is True
    finally:
        vllm.service_ready.cache_clear()


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
    assert isinstance(b, vllm_base) and b.get_name() == "ZEN_MLA"
    assert type(b.clone()) is cls


def test_elsewhere_it_stands_alone(monkeypatch):
    """Where vLLM cannot be imported (here: made unimportable, so this holds with vLLM
    installed too)."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    vllm.backend_class.cache_clear()
    try:
        assert vllm.ZenMLARemotePrefillBackend is RemotePrefillBackend
    finally:
        vllm.backend_class.cache_clear()
    assert RemotePrefillBackend.__mro__ == (RemotePrefillBackend, object)


def test_the_plugin_does_nothing_without_zen_mla_url(monkeypatch, vllm_registry):
    monkeypatch.delenv("ZEN_MLA_URL", raising=False)
    vllm.register()
    assert vllm_registry.calls == []


@pytest.mark.parametrize("amx", [False, True], ids=["no_amx", "amx"])
def test_on_vllms_cpu_platform_the_plugin_takes_its_prefill_entries(
    monkeypatch, vllm_registry, caplog, amx
):
    """Two lines per registration (the prefill backends, the latent), and one of guidance:
    where the CPU has AMX (stood in for here, so that the test says the same on every host) a
    warning naming the attention backend to choose, else which of zen-mla's modes was
    fastest."""
    monkeypatch.setenv("ZEN_MLA_URL", "http://cpu-node:8000")
    monkeypatch.setattr(vllm.plugin, "_amx", lambda: amx)
    with caplog.at_level(logging.INFO, logger="zen_mla.vllm"):
        vllm.register()
        vllm.register()  # vLLM may load plugins again: no harm
    path = "zen_mla.vllm.ZenMLARemotePrefillBackend"
    once = [("ZEN_MLA", path), ("ZEN_CPU", path), ("CPU", path)]
    assert vllm_registry.calls == once + once
    # CPU_MLA's class on the CPU platform, which sends the latent to the service
    assert vllm_registry.attention == [("CPU_MLA", vllm.plugin.CPU_MLA_PATH)] * 2
    each = [
        (logging.INFO, "CPU platform prefill backends ZEN_CPU and CPU"),
        (logging.INFO, "cached context is attended from the latent by the service"),
    ]
    if amx:
        each.append((logging.WARNING, "unless vLLM runs with --attention-backend CPU_MLA"))
    else:
        each.append((logging.INFO, "its prefill is zen-mla's; on one host zen-mla in process"))
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "zen_mla.vllm"]
    assert len(said) == 2 * len(each), said
    for (level, line), (want_level, want) in zip(said, each + each, strict=True):
        assert level == want_level and want in line, line
    module, _, name = path.rpartition(".")
    assert getattr(sys.modules[module], name) is vllm.backend_class()


def test_on_other_platforms_it_registers_its_own_name_only(monkeypatch, vllm_registry, caplog):
    monkeypatch.setenv("ZEN_MLA_URL", "http://gpu-host-cpus:8000")
    vllm_registry.platform.cpu = False
    with caplog.at_level(logging.INFO, logger="zen_mla.vllm"):
        vllm.register()
    assert vllm_registry.calls == [("ZEN_MLA", "zen_mla.vllm.ZenMLARemotePrefillBackend")]
    (said,) = [r.getMessage() for r in caplog.records if r.name == "zen_mla.vllm"]
    assert """--attention-config '{"mla_prefill_backend": "ZEN_MLA"}'""" in said


def test_the_plugin_refuses_settings_it_cannot_read(monkeypatch, vllm_registry):
    monkeypatch.setenv("ZEN_MLA_URL", "cpu-node:8000")
    with pytest.raises(zen_mla.InvalidInputError, match="ZEN_MLA_URL"):
        vllm.register()
    assert vllm_registry.calls == []


def test_a_503_is_computed_here(health_says):
    settings = health_says({"status": "draining"})
    b = backend(
        RemoteSettings(urls=settings.urls, probe_interval_s=60.0, probe_max_interval_s=60.0)
    )
    b.prepare_metadata(_Meta())
    q, k, v = _qkv()
    before = vllm.stats.snapshot()
    out = b.run_prefill_new_tokens(q, k, v, False)
    assert torch.equal(out, zen_mla.ragged_attention(q, k, v, _Meta.query_start_loc, scale=0.25))
    assert vllm.stats.snapshot().local - before.local == 1 and not b.link.up
