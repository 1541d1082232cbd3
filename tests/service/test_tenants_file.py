"""The tenants file is read once, when the settings are made: what was read goes with the path
(`TenantsFile`, which shows as the path alone), the service's `Tenants` take it without reading
the file again, and neither a copy nor a pickle of the settings reads it."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

from service import tenants
from service.settings import Settings
from service.tenants import Tenants, TenantsFile
from zen_mla.caller import Caller


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each path `read_tenants` is called with."""
    read, seen = tenants.read_tenants, []

    def counted(path: str) -> dict[str, str]:
        seen.append(path)
        return read(path)

    monkeypatch.setattr(tenants, "read_tenants", counted)
    return seen


def test_the_settings_read_the_file_once_and_the_tenants_take_what_they_read(
    tmp_path: Path, reads: list[str]
) -> None:
    path = tmp_path / "tenants"
    path.write_text("team-a alpha-token\nteam-b beta-token\n")
    settings = Settings(api_token="shared-token", tenants_file=str(path))
    assert reads == [str(path)]
    path.write_text("team-c gamma-token\n")  # changed after the start: the start's tenants hold
    token = settings.api_token.get_secret_value() if settings.api_token else None
    held = Tenants.from_settings(token, settings.tenants_file)
    assert reads == [str(path)]
    assert held.caller("alpha-token") == Caller.tenant("team-a")
    assert held.caller("shared-token") == Caller.tenant(tenants.SHARED_TENANT)
    for kept in (copy.deepcopy(settings), pickle.loads(pickle.dumps(settings))):
        assert isinstance(kept.tenants_file, TenantsFile)
        assert kept.tenants_file.tokens == {"alpha-token": "team-a", "beta-token": "team-b"}
    assert reads == [str(path)]


def test_the_file_shows_as_its_path_alone(tmp_path: Path) -> None:
    path = tmp_path / "tenants"
    path.write_text("team-a alpha-token\n")
    settings = Settings(tenants_file=str(path))
    assert settings.tenants_file == str(path) and repr(settings.tenants_file) == repr(str(path))
    assert "alpha-token" not in repr(settings) + settings.model_dump_json()


def test_a_path_given_by_hand_is_read(tmp_path: Path, reads: list[str]) -> None:
    path = tmp_path / "tenants"
    path.write_text("team-a alpha-token\n")
    assert Tenants.from_settings(None, str(path)).caller("alpha-token") == Caller.tenant("team-a")
    assert reads == [str(path)]
