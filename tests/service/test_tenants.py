"""Tenant tokens: the file's rules, each refusal saying which line and why, whom each token
names, and the shared token refused where it is a tenant's too (in-process, and by a real
`zen-mla serve`, which stops before it starts anything)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from bench._server import ROOT, SERVE, free_port
from service.settings import Settings
from service.tenants import SHARED_TENANT, Tenants, read_tenants
from zen_mla import UnauthorizedError
from zen_mla.caller import Caller


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tenants"
    path.write_text(text)
    return str(path)


def test_a_file_names_each_tenant_by_its_token(tmp_path: Path):
    path = _file(tmp_path, "# who may come in\nteam-a alpha-token\n\n  team.b   beta-token  \n")
    assert read_tenants(path) == {"alpha-token": "team-a", "beta-token": "team.b"}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("team-a\n", "line 1: expected 'NAME TOKEN', got 1 words"),
        ("team-a tok extra\n", "line 1: expected 'NAME TOKEN', got 3 words"),
        ("a t1\na t2\n", "line 2: tenant 'a' is named twice"),
        ("a same\nb same\n", "line 2: its token is 'a''s too"),
        ("# nobody\n", "names no tenant"),
        ("* tok\n", "line 1: a tenant's name is letters"),
    ],
)
def test_a_bad_file_is_refused_saying_which_line_and_why(tmp_path: Path, text: str, says: str):
    with pytest.raises(ValueError, match=says.replace("*", r"\*")):
        read_tenants(_file(tmp_path, text))


def test_a_missing_file_stops_the_settings(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot be read"):
        Settings(tenants_file=str(tmp_path / "none"))


def test_each_token_names_its_tenant_and_the_shared_token_one_more():
    tenants = Tenants("shared-token", {"alpha": "a", "beta": "b"})
    assert tenants.caller("alpha") == Caller.tenant("a")
    assert tenants.caller("beta") == Caller.tenant("b")
    assert tenants.caller("shared-token") == Caller.tenant(SHARED_TENANT)
    for bad in (None, "", "alph", "alpha ", "gamma"):
        with pytest.raises(UnauthorizedError):
            tenants.caller(bad)


def test_without_tenants_the_peer_is_the_caller():
    assert Tenants(None).caller(None) is None  # no token asked, the door's peer counts
    shared = Tenants("tok")
    assert shared.caller("tok") is None  # one token for all: callers are still their peers
    with pytest.raises(UnauthorizedError):
        shared.caller("other")


SHARED_TOO = "beta-token-Zq81"  # team-b's, and set as the shared token too


def test_the_shared_token_equal_to_a_tenants_is_refused_naming_the_tenant_not_the_token():
    with pytest.raises(ValueError, match="tenant 'b'") as refused:
        Tenants(SHARED_TOO, {"alpha": "a", SHARED_TOO: "b"})
    said = str(refused.value)
    assert "api_token (ZEN_MLA_API_TOKEN)" in said and SHARED_TOO not in said


def test_the_settings_refuse_it_naming_the_file_and_the_tenant(tmp_path: Path):
    path = _file(tmp_path, f"team-a alpha-token\nteam-b {SHARED_TOO}\n")
    with pytest.raises(ValidationError) as refused:
        Settings(api_token=SHARED_TOO, tenants_file=path)
    said = str(refused.value)
    assert f"got the token of tenant 'team-b' in tenants file {path}" in said
    assert "api_token (ZEN_MLA_API_TOKEN)" in said and SHARED_TOO not in said
    with pytest.raises(ValueError, match="tenant 'team-b'"):
        Tenants.from_settings(SHARED_TOO, path)
    # a token of its own is one more tenant, as before
    assert Settings(api_token="shared-token", tenants_file=path).tenants_file == path


def test_no_refusal_of_the_settings_prints_the_token(tmp_path: Path):
    """pydantic shows what it was given beside a refusal of the whole: api_token's value would
    be among it (the settings hide what they were given)."""
    with pytest.raises(ValidationError) as refused:
        Settings(api_token=SHARED_TOO, max_body_bytes=2, max_inflight_bytes=1)
    assert "max_inflight_bytes" in str(refused.value) and SHARED_TOO not in str(refused.value)


def test_zen_mla_serve_refuses_to_start_with_one_line(tmp_path: Path):
    """As every refused setting: exit 2, the reason on stderr, no traceback, no token."""
    path = _file(tmp_path, f"team-a alpha-token\nteam-b {SHARED_TOO}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEN_MLA_")}
    env |= {"ZEN_MLA_API_TOKEN": SHARED_TOO, "ZEN_MLA_TENANTS_FILE": path}
    done = subprocess.run(
        [*SERVE, "--port", str(free_port()), "--grpc-port", "0", "--workers", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("zen-mla serve: 1 validation error for Settings")
    assert (
        "api_token (ZEN_MLA_API_TOKEN): expected a token of its own, got the token of tenant "
        f"'team-b' in tenants file {path}" in done.stderr
    )
    assert SHARED_TOO not in done.stderr + done.stdout and "Traceback" not in done.stderr
