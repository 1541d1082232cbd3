"""Tenant tokens (no server): the file's rules, each refusal saying which line and why, and
whom each token names."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.settings import Settings
from service.tenants import SHARED_TENANT, Tenants, read_tenants
from zen_mla import UnauthorizedError


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
    assert tenants.client("alpha") == ("tenant", "a")
    assert tenants.client("beta") == ("tenant", "b")
    assert tenants.client("shared-token") == ("tenant", SHARED_TENANT)
    for bad in (None, "", "alph", "alpha ", "gamma"):
        with pytest.raises(UnauthorizedError):
            tenants.client(bad)


def test_without_tenants_the_peer_is_the_client():
    assert Tenants(None).client(None) is None  # no token asked, the door's peer counts
    shared = Tenants("tok")
    assert shared.client("tok") is None  # one token for all: clients are still their peers
    with pytest.raises(UnauthorizedError):
        shared.client("other")
