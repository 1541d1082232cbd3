"""The calibration behind "auto" (zen_mla.attention.calibrate): real kernels timed on the
scaled-down contract batches, the winner by the geometric mean of each batch's time over the
fastest's, kept on disk per host and build, one process measuring while the others wait."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zen_mla.attention import calibrate
from zen_mla.attention.kernels import ReferenceKernel, TorchFlashKernel

ROOT = Path(__file__).resolve().parents[2]
KERNELS = (TorchFlashKernel, ReferenceKernel)  # both run on every host
BUILD = {"cpu": "test", "torch": torch.__version__}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEN_MLA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_winner_is_the_least_geometric_mean_of_the_batches_ratios():
    batches = list(calibrate.BATCHES)
    # a: 1.0 on every batch; b: 0.5 on one batch and 1.5 on the others (geometric mean ~1.19)
    seconds = {
        "a": dict.fromkeys(batches, 1.0),
        "b": {name: 0.5 if i == 0 else 1.5 for i, name in enumerate(batches)},
    }
    got = calibrate.Calibration(seconds, threads=2, cached=False)
    assert got.winner == "a"
    assert got.relative["b"] / got.relative["a"] == pytest.approx(1.5**0.75 / 2**0.25)
    assert "a measured fastest here (b " in got.reason()
    assert got.as_dict()["winner"] == "a" and set(got.as_dict()["seconds"]) == {"a", "b"}


def test_a_calibration_is_measured_once_and_then_read_from_disk(cache_dir):
    first = calibrate.calibrated(KERNELS, torch.bfloat16, return_lse=True, build=BUILD)
    assert not first.cached and first.threads == torch.get_num_threads()
    assert set(first.seconds) == {"torch", "reference"}
    assert all(
        set(v) == set(calibrate.BATCHES) and min(v.values()) > 0 for v in first.seconds.values()
    )
    again = calibrate.calibrated(KERNELS, torch.bfloat16, return_lse=True, build=BUILD)
    assert again.cached and again.seconds == first.seconds and again.winner == first.winner
    assert "kept from an earlier run" in again.reason()
    other = calibrate.calibrated(
        KERNELS, torch.bfloat16, return_lse=True, build={**BUILD, "torch": "x"}
    )
    assert not other.cached  # another build: measured again, and both kept
    assert len(json.loads((cache_dir / "calibration.json").read_text())) == 2


def test_a_torn_cache_file_is_measured_again_and_rewritten(cache_dir):
    cache_dir.mkdir()
    (cache_dir / "calibration.json").write_text('{"abc": ')
    got = calibrate.calibrated(KERNELS, torch.bfloat16, return_lse=False, build=BUILD)
    assert not got.cached
    kept = json.loads((cache_dir / "calibration.json").read_text())
    assert [entry["kernels"] for entry in kept.values()] == [["torch", "reference"]]


def test_where_the_cache_cannot_be_written_each_process_measures(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ZEN_MLA_CACHE_DIR", str(blocker / "cache"))  # under a file: no folder
    got = calibrate.calibrated(KERNELS, torch.bfloat16, return_lse=False, build=BUILD)
    assert not got.cached and got.winner in {"torch", "reference"}


class _Raising(TorchFlashKernel):
    """Passed its probe, yet raises on the calibration's batches."""

    name = "raising"

    @classmethod
    def forward(cls, call):
        raise RuntimeError("Illegal instruction")


def test_a_kernel_that_raises_is_left_out_and_named(cache_dir):
    got = calibrate.calibrated(
        (_Raising, TorchFlashKernel), torch.bfloat16, return_lse=False, build=BUILD
    )
    assert got.winner == "torch" and set(got.seconds) == {"torch"}
    assert got.failed == {"raising": "RuntimeError: Illegal instruction"}
    assert "raising raised on it: RuntimeError: Illegal instruction" in got.reason()
    again = calibrate.calibrated(
        (_Raising, TorchFlashKernel), torch.bfloat16, return_lse=False, build=BUILD
    )
    assert again.cached and again.failed == got.failed and again.winner == "torch"


CALIBRATE = """
import json, torch
from zen_mla.attention import calibrate
from zen_mla.attention.kernels import ReferenceKernel, TorchFlashKernel
got = calibrate.calibrated((TorchFlashKernel, ReferenceKernel), torch.bfloat16, return_lse=False,
                           build={"cpu": "test"})
print(json.dumps({"cached": got.cached, "seconds": got.seconds}))
"""


@pytest.mark.slow
def test_processes_starting_at_once_measure_once(cache_dir):
    """Three processes (as a pool's workers start) with no calibration kept: one measures, the
    others wait on the lock and read its figures."""
    env = {**__import__("os").environ, "ZEN_MLA_CACHE_DIR": str(cache_dir)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CALIBRATE], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    results = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert sorted(r["cached"] for r in results) == [False, True, True]
    assert all(r["seconds"] == results[0]["seconds"] for r in results)


def test_calibrate_off_by_the_environment(monkeypatch):
    for said, enabled in (("0", False), ("off", False), ("no", False), ("1", True), ("", True)):
        monkeypatch.setenv("ZEN_MLA_CALIBRATE", said)
        assert calibrate.calibration_enabled() is enabled
