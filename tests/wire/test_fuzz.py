"""A bounded run of the atheris fuzz target (fuzz/fuzz_wire.py): 20,000 inputs, no crash."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed")
def test_fuzz_wire_bounded(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "fuzz" / "fuzz_wire.py"),
            "-runs=20000",
            "-seed=1",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DONE" in done.stderr and "cov:" in done.stderr
