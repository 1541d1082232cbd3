"""The Dockerfile, compose file and Kubernetes manifests: linted, schema-checked, and every
command and setting they use is one the CLI and the settings accept."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.cli import build_parser
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed (it is a dev dependency: scripts/bootstrap installs it)"
        )
    return str(path)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, check=False)


def test_hadolint_finds_nothing():
    done = run(tool("hadolint"), "--failure-threshold", "info", "Dockerfile")
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_compose_file_matches_the_compose_spec():
    done = run(
        tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", "docker-compose.yml"
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_kubernetes_manifests_validate():
    manifests = sorted(str(p) for p in (ROOT / "deploy" / "k8s").glob("*.yaml"))
    assert manifests
    done = run(tool("kubernetes-validate"), *manifests)
    assert done.returncode == 0, done.stdout + done.stderr


def _dockerfile_json_args(instruction: str) -> list[list[str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [json.loads(m) for m in re.findall(rf"^\s*{instruction}\b.*?(\[.*\])\s*$", text, re.M)]


def _cli_accepts(argv: list[str]) -> None:
    assert argv[0] == "zen-mla", argv
    build_parser().parse_args(argv[1:])  # SystemExit on an unknown command or flag


def test_image_commands_are_ones_the_cli_accepts():
    commands = _dockerfile_json_args("CMD") + _dockerfile_json_args("HEALTHCHECK.*CMD")
    assert len(commands) == 2
    for argv in commands:
        _cli_accepts(argv)
    assert commands[0][:4] == ["zen-mla", "serve", "--host", "0.0.0.0"]


def test_compose_commands_and_settings_are_known():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    fields = {f"ZEN_MLA_{name.upper()}" for name in Settings.model_fields}
    grace = Settings().drain_timeout_s
    for name, service in compose["services"].items():
        _cli_accepts(service["healthcheck"]["test"][1:])
        env = service.get("environment", {})
        assert set(env) <= fields, (name, set(env) - fields)
        Settings(**{k.removeprefix("ZEN_MLA_").lower(): v for k, v in env.items()})
        drain = float(env.get("ZEN_MLA_DRAIN_TIMEOUT_S", grace))
        assert float(service["stop_grace_period"].rstrip("s")) > drain, name


def test_kubernetes_commands_and_settings_are_known():
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    spec = deployment["spec"]["template"]["spec"]
    container = spec["containers"][0]
    _cli_accepts(container["command"] + container["args"])
    fields = {f"ZEN_MLA_{name.upper()}" for name in Settings.model_fields}
    assert {e["name"] for e in container["env"]} <= fields
    assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed
    assert float(container["resources"]["limits"]["cpu"]).is_integer()  # whole, exclusive cores
    drain = next(
        float(e["value"]) for e in container["env"] if e["name"] == "ZEN_MLA_DRAIN_TIMEOUT_S"
    )
    assert spec["terminationGracePeriodSeconds"] > drain
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
