"""`zen-mla serve`'s flags are the Settings fields: one flag per field (secrets excepted), each
landing in its own field, an unset one leaving the environment's value or the default."""

from __future__ import annotations

import argparse
import atexit
import os
import tempfile
import types
from typing import Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import Field

from service import cli
from service.cli import build_parser, settings_from_args
from service.settings import Settings

#: the flags `zen-mla serve` had when they were made from Settings (docs/settings.md: flag
#: names are part of the protocol): renaming a field renames its flag, which this list refuses
FLAGS = [
    "--host",
    "--port",
    "--uds",
    "--workers",
    "--smt",
    "--max-body-bytes",
    "--max-queue",
    "--deadline-s",
    "--max-work",
    "--max-seqs",
    "--drain-timeout-s",
    "--max-uploads",
    "--max-inflight-bytes",
    "--min-body-rate",
    "--body-grace-s",
    "--max-header-bytes",
    "--header-timeout-s",
    "--max-connections",
    "--fd-reserve",
    "--linger-s",
    "--linger-bytes",
    "--shared-memory",
    "--no-shared-memory",
    "--shm-socket",
    "--shm-max-regions",
    "--shm-max-bytes",
    "--shm-max-total-bytes",
    "--shm-max-clients",
    "--shm-max-waiting",
    "--system-shm",
    "--no-system-shm",
    "--system-shm-max-regions",
    "--system-shm-max-bytes",
    "--max-json-bytes",
    "--http",
    "--log-level",
]
#: fields set through the environment only (a command line is visible to every user)
SECRETS = {"api_token"}

#: named round trips: argv after `serve`, the field, what it must hold
CASES: dict[str, tuple[list[str], str, object]] = {
    "int": (["--max-queue", "3"], "max_queue", 3),
    "float": (["--deadline-s", "1.5"], "deadline_s", 1.5),
    "bool on": (["--smt"], "smt", True),
    "bool off": (["--no-shared-memory"], "shared_memory", False),
    "literal": (["--http", "h11"], "http", "h11"),
    "auto or a number": (["--workers", "3"], "workers", 3),
    "auto": (["--workers", "auto"], "workers", "auto"),
    "optional path": (["--uds", "/run/zen-mla.sock"], "uds", "/run/zen-mla.sock"),
    "optional int": (["--shm-max-total-bytes", "4096"], "shm_max_total_bytes", 4096),
}


@pytest.fixture(autouse=True)
def _no_zen_mla_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in os.environ:
        if name.startswith("ZEN_MLA_"):
            monkeypatch.delenv(name)


def flag_of(field: str) -> str:
    return "--" + field.replace("_", "-")


def kinds_of(annotation: Any) -> list[Any]:
    if get_origin(annotation) in (Union, types.UnionType):
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def flags() -> dict[str, str]:
    """option string -> dest of every serve flag but -h."""
    return {
        option: action.dest
        for action in serve_parser(build_parser())._actions
        if action.dest != "help"
        for option in action.option_strings
    }


def parse(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_every_field_but_secrets_is_a_flag_and_every_flag_a_field():
    found = flags()
    assert set(found.values()) == set(Settings.model_fields) - SECRETS
    for option, dest in found.items():
        assert option in {flag_of(dest), "--no-" + flag_of(dest)[2:]}, (option, dest)
    assert {n for n, f in Settings.model_fields.items() if cli.is_secret(f)} == SECRETS


def test_no_flag_of_the_contract_is_lost():
    assert set(FLAGS) <= set(flags()), set(FLAGS) - set(flags())


def test_every_flag_says_what_it_does():
    for name, field in Settings.model_fields.items():
        assert field.description, f"Settings.{name} has no description (its flag's help)"


def test_a_secret_is_no_flag(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--api-token", "t0k"])
    assert exit_.value.code == 2
    monkeypatch.setenv("ZEN_MLA_API_TOKEN", "t0k")
    token = parse().api_token
    assert token is not None and token.get_secret_value() == "t0k"


@pytest.mark.parametrize("case", CASES)
def test_named_round_trips(case: str):
    argv, field, expected = CASES[case]
    assert getattr(parse(*argv), field) == expected


_TENANTS = tempfile.NamedTemporaryFile("w", suffix=".tenants", delete=False)  # noqa: SIM115
_TENANTS.write("team-a token-a\n")
_TENANTS.close()
atexit.register(os.unlink, _TENANTS.name)  # read while the tests are collected and run


def _other_than_default(name: str) -> tuple[list[str], object]:
    """argv that sets the field `name` to a valid value unlike its default, and that value."""
    field = Settings.model_fields[name]
    flag, default = flag_of(name), field.default
    kinds = kinds_of(field.annotation)
    if kinds == [bool]:
        return ([flag] if not default else [f"--no-{flag[2:]}"]), not default
    literals = [v for k in kinds if get_origin(k) is Literal for v in get_args(k)]
    if int in kinds:  # + 2: --port 8001 would be the gRPC port's default
        value: Any = (default if isinstance(default, int) else 4096) + 2
    elif float in kinds:
        value = default + 0.5
    elif name == "tenants_file":  # read as the settings are made: a real one
        value = _TENANTS.name
    elif str in kinds:
        value = "/run/zen-mla-flag"
    else:
        value = next(v for v in literals if v != default)
    return [flag, str(value)], value


@pytest.mark.parametrize("name", sorted(set(Settings.model_fields) - SECRETS))
def test_each_flag_lands_in_its_field_alone(name: str):
    argv, value = _other_than_default(name)
    got, default = parse(*argv).model_dump(), Settings().model_dump()
    assert got[name] == value
    assert {k for k in got if got[k] != default[k]} == {name}


def test_an_unset_flag_leaves_the_environment_and_a_flag_wins(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ZEN_MLA_MAX_QUEUE", "5")
    monkeypatch.setenv("ZEN_MLA_SHARED_MEMORY", "false")
    monkeypatch.setenv("ZEN_MLA_WORKERS", "2")
    s = parse()
    assert (s.max_queue, s.shared_memory, s.workers, s.deadline_s) == (5, False, 2, 60.0)
    s = parse("--max-queue", "7", "--shared-memory", "--workers", "auto")
    assert (s.max_queue, s.shared_memory, s.workers) == (7, True, "auto")


def test_a_bad_value_is_refused_by_name():
    with pytest.raises(SystemExit):  # argparse: not a number, not a choice
        build_parser().parse_args(["serve", "--max-queue", "many"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-level", "loud"])
    with pytest.raises(ValueError, match="workers"):  # Settings: its own rules
        parse("--workers", "many")
    with pytest.raises(ValueError, match="max_queue"):
        parse("--max-queue", "0")


def test_a_new_field_is_a_flag_with_no_second_edit(monkeypatch: pytest.MonkeyPatch):
    class More(Settings):
        new_knob: int = Field(3, ge=1, description="a knob added later")

    monkeypatch.setattr(cli, "Settings", More)
    assert flags()["--new-knob"] == "new_knob"
    args = build_parser().parse_args(["serve", "--new-knob", "9"])
    assert cli.settings_from_args(args).new_knob == 9  # type: ignore[attr-defined]
    assert "a knob added later (default: 3)" in serve_parser(build_parser()).format_help()


def test_a_field_of_a_type_with_no_flag_fails_the_parser(monkeypatch: pytest.MonkeyPatch):
    class Odd(Settings):
        tags: dict[str, int] = Field(default_factory=dict, description="no flag for this")

    monkeypatch.setattr(cli, "Settings", Odd)
    with pytest.raises(TypeError, match=r"Settings\.tags"):
        build_parser()
