"""zen_mla/envs.py: the one table of the library's and the vLLM backend's variables. Each parser
takes what it should and refuses the rest naming the variable, what it takes and what came; a
variable is read when asked (the environment as it is then, or a mapping given); the defaults
the docs show are the table's own; the default URL and the token rule have this one home, which
the client, `zen-mla health`, the service's settings and the vLLM backend all use."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from service.cli import build_parser
from service.settings import Settings
from zen_mla import InvalidInputError, envs
from zen_mla.attention import calibrate
from zen_mla.client import AsyncPrefillClient, PrefillClient
from zen_mla.envs import VARIABLES
from zen_mla.vllm.settings import RemoteSettings

ROOT = Path(__file__).resolve().parents[1]

#: variable -> (text set, the value it reads as)
TAKEN = {
    "url_one": ("ZEN_MLA_URL", "http://a:1", ("http://a:1",)),
    "url_several": ("ZEN_MLA_URL", " http://a:1, https://b:2,", ("http://a:1", "https://b:2")),
    "url_local": ("ZEN_MLA_URL", "local", ("local",)),
    "token": ("ZEN_MLA_API_TOKEN", " s3cret ", " s3cret "),
    "fallback_off": ("ZEN_MLA_FALLBACK", " OFF ", False),
    "fallback_on": ("ZEN_MLA_FALLBACK", "yes", True),
    "kernel": ("ZEN_MLA_KERNEL", " native ", "native"),
    "kernel_blank": ("ZEN_MLA_KERNEL", "  ", "auto"),
    "calibrate_off": ("ZEN_MLA_CALIBRATE", "No", False),
    "calibrate_other_word": ("ZEN_MLA_CALIBRATE", "maybe", True),
    "cache_dir": ("ZEN_MLA_CACHE_DIR", "/var/cache/z", "/var/cache/z"),
    "cache_dir_empty": ("ZEN_MLA_CACHE_DIR", "", None),
    "isa": ("ZEN_MLA_NATIVE_ISA", " AVX2 ", "avx2"),
    "isa_blank": ("ZEN_MLA_NATIVE_ISA", "", "auto"),
}

#: variable -> (text set, what the refusal says after "NAME: expected ")
REFUSED = {
    "url_none": ("ZEN_MLA_URL", " , ", "one http(s) URL or more, got none"),
    "url_empty": ("ZEN_MLA_URL", "", "one http(s) URL or more, got none"),
    "token_empty": ("ZEN_MLA_API_TOKEN", "", "a non-empty token, or the variable unset, got it"),
    "token_blank": ("ZEN_MLA_API_TOKEN", " \t", "a non-empty token, or the variable unset, got it"),
    "fallback": ("ZEN_MLA_FALLBACK", "maybe", "1 or 0 (true/false, yes/no, on/off), got 'maybe'"),
}


@pytest.mark.parametrize(("name", "text", "value"), TAKEN.values(), ids=TAKEN.keys())
def test_each_parser_takes_what_it_should(name: str, text: str, value: object) -> None:
    assert VARIABLES[name].read({name: text}) == value


@pytest.mark.parametrize(("name", "text", "says"), REFUSED.values(), ids=REFUSED.keys())
def test_a_refusal_names_the_variable_what_it_takes_and_what_came(
    name: str, text: str, says: str
) -> None:
    with pytest.raises(InvalidInputError, match="^" + re.escape(f"{name}: expected {says}")):
        VARIABLES[name].read({name: text})


@given(st.text(max_size=12))
def test_the_switch_is_1_or_0_and_their_words_and_nothing_else(text: str) -> None:
    word = text.strip().lower()
    try:
        value = envs.ZEN_MLA_FALLBACK.check(text)
    except InvalidInputError as exc:
        assert word not in ("1", "true", "yes", "on", "0", "false", "no", "off")
        assert exc.name == "ZEN_MLA_FALLBACK" and exc.got == repr(word)
    else:
        assert value is (word in ("1", "true", "yes", "on"))


@given(st.text(max_size=40))
def test_a_url_list_is_its_non_blank_entries_or_refused(text: str) -> None:
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if entries:
        assert envs.ZEN_MLA_URL.check(text) == tuple(entries)
    else:
        with pytest.raises(InvalidInputError, match=r"^ZEN_MLA_URL: "):
            envs.ZEN_MLA_URL.check(text)


def test_a_variable_is_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in VARIABLES.values():
        monkeypatch.delenv(variable.name, raising=False)
        assert variable.read() == variable.default and not variable.is_set()
    monkeypatch.setenv("ZEN_MLA_KERNEL", "torch")
    assert envs.ZEN_MLA_KERNEL.read() == "torch" and envs.ZEN_MLA_KERNEL.is_set()
    monkeypatch.setenv("ZEN_MLA_KERNEL", "reference")
    assert envs.ZEN_MLA_KERNEL.read() == "reference"
    assert envs.ZEN_MLA_KERNEL.read({}) == "auto"  # a mapping given is read, not os.environ
    monkeypatch.setenv("ZEN_MLA_URL", " ")
    assert not envs.ZEN_MLA_URL.is_set()


def _shown(default: object) -> str:
    if default is None:
        return "none"
    if isinstance(default, bool):
        return f"`{int(default)}`"
    if isinstance(default, tuple):
        return f"`{','.join(default)}`"
    return f"`{default}`"


#: variables whose default the reader works out at run time, and the one it works out here
COMPUTED = {"ZEN_MLA_CACHE_DIR"}


@pytest.mark.parametrize("name", sorted(VARIABLES.keys() - COMPUTED))
def test_the_default_the_docs_show_is_the_default(name: str) -> None:
    assert VARIABLES[name].shown == _shown(VARIABLES[name].default)


def test_the_cache_dir_s_default_is_the_one_shown(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("ZEN_MLA_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    shown = envs.ZEN_MLA_CACHE_DIR.shown.strip("`").replace("~", str(tmp_path))
    assert calibrate.cache_path().parent == Path(shown)
    monkeypatch.setenv("ZEN_MLA_CACHE_DIR", str(tmp_path / "kept"))
    assert calibrate.cache_path().parent == tmp_path / "kept"


def test_every_variable_is_named_as_its_key_and_means_something() -> None:
    for name, variable in VARIABLES.items():
        assert variable.name == name and name.startswith("ZEN_MLA_")
        assert variable.meaning and "\n" not in variable.meaning
        assert getattr(envs, name) is variable  # `envs.ZEN_MLA_URL` is the table's row


def test_the_default_url_is_written_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Where the service listens by default is zen_mla/envs.py's DEFAULT_URL: the clients, the
    vLLM backend and `zen-mla health` take it from there."""
    written = [
        str(path.relative_to(ROOT))
        for top in ("zen_mla", "service")
        for path in sorted((ROOT / top).rglob("*.py"))
        if "127.0.0.1:8000" in path.read_text()
    ]
    assert written == ["zen_mla/envs.py"]
    for client in (PrefillClient, AsyncPrefillClient):
        assert inspect.signature(client).parameters["url"].default == envs.DEFAULT_URL
    assert RemoteSettings.from_env({}).urls == (envs.DEFAULT_URL,)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["health", "--help"])
    assert f"else {envs.DEFAULT_URL}" in " ".join(capsys.readouterr().out.split())


TOKENS = {"empty": "", "blank": "  ", "tab": "\t", "token": "t0k", "padded": " t0k "}


@pytest.mark.parametrize("token", TOKENS.values(), ids=TOKENS.keys())
def test_the_service_and_the_vllm_backend_refuse_the_same_tokens(token: str) -> None:
    """One rule, `ZEN_MLA_API_TOKEN`'s: the service's settings refuse a token exactly where the
    vLLM backend does, with the table's words."""
    try:
        envs.ZEN_MLA_API_TOKEN.check(token)
    except InvalidInputError as exc:
        rule: str | None = str(exc)
    else:
        rule = None
    try:
        RemoteSettings(token=token)
    except InvalidInputError as exc:
        assert str(exc) == rule
    else:
        assert rule is None
    try:
        Settings(api_token=token)
    except ValidationError as exc:
        assert rule is not None and rule in str(exc) and "api_token" in str(exc)
    else:
        assert rule is None
