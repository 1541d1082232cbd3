"""`zen-mla health` against a real server: one endpoint or ZEN_MLA_URL's several, each checked,
exit 0 only when every one is ready."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from bench._server import ROOT, SERVE, free_port
from service import cli


def _health(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(["health", *argv])
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def _closed_port() -> str:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.slow
def test_one_endpoint_prints_its_health(server, capsys):
    code, out, _ = _health(capsys, server.url, "--timeout", "10")
    assert code == 0 and json.loads(out)["status"] == "ok"


@pytest.mark.slow
def test_every_endpoint_of_zen_mla_url_is_checked(server, capsys, monkeypatch):
    monkeypatch.setenv("ZEN_MLA_URL", f"{server.url}, {server.url}/")
    code, out, _ = _health(capsys)  # the default is read when the parser is built
    assert code == 0 and out.count(f"{server.url}: ") == 2
    dead = _closed_port()
    code, _, err = _health(capsys, f"{server.url},{dead}", "--timeout", "2")
    assert code == 1 and f"{dead}: unreachable" in err


def test_local_is_no_service_to_check(capsys, monkeypatch):
    monkeypatch.setenv("ZEN_MLA_URL", "local")
    code, _, err = _health(capsys)
    assert code == 2 and "expected the service's URL" in err and "'local'" in err


@pytest.mark.slow
def test_a_grpc_port_in_use_stops_the_start_with_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZEN_MLA_")}
        done = subprocess.run(
            [*SERVE, "--port", str(free_port()), "--grpc-port", str(port), "--workers", "1"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"gRPC: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
