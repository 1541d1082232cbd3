"""`zen-mla bench`: every benchmark under bench/ can be run by name, and a wrong name is refused
before anything runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import BENCHES, DEFAULT_BENCHES, main

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _scripts() -> set[str]:
    """The benchmarks: the files under bench/ that run as scripts."""
    main_guard = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)
    return {p.stem for p in BENCH.glob("*.py") if main_guard.search(p.read_text())}


def test_every_benchmark_under_bench_is_known_by_name():
    # docs/benchmarks.md names bench/floor.py and bench/step.py: `zen-mla bench` runs every one.
    assert set(BENCHES) == _scripts()
    assert set(DEFAULT_BENCHES) <= set(BENCHES)


def test_an_unknown_name_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", "kernel", "nope"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unknown ['nope']" in err
    assert all(name in err for name in BENCHES)


@pytest.mark.parametrize("name", sorted(set(BENCHES) - {"e2e"}))
def test_a_benchmark_runs_on_the_runtime_dependencies_alone(name):
    """Where only the service's own dependencies are installed (a GPU node's image): every
    benchmark but the KServe one imports without tritonclient and its ml_dtypes (on a GPU node
    bench/step.py and bench/floor.py failed at import, through bench/e2e.py)."""
    blocked = "import sys; sys.modules['tritonclient'] = sys.modules['ml_dtypes'] = None; "
    code = blocked + f"sys.path.insert(0, 'bench'); import {name}"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=BENCH.parent, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
