"""The calibration cache as untrusted input (zen_mla.attention.calibrate): whoever can write
`ZEN_MLA_CACHE_DIR` can plant anything there (JSON nested past any sense, zero, negative or
NaN seconds, wrong types, kernels never measured, a FIFO, a link, a 512 MiB file, a folder).
Whatever is planted, "auto" still resolves, in bounded time and memory, a warning names the
file and what was wrong, and the next write puts a good file in its place (the plant at the
path replaced, never followed). Most tests stand a fake in for the kernels' timing (the cache's
reading is what is tested, not the measuring: tests/attention/test_calibrate.py measures); the
slow ones start a real `zen-mla serve` on a planted cache."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tests.reference import assert_close_to_reference
from zen_mla.attention import auto, calibrate, select
from zen_mla.attention.kernels import KERNELS, ReferenceKernel, TorchFlashKernel
from zen_mla.attention.status import host_kernels, host_status

ROOT = Path(__file__).resolve().parents[2]
KERNEL_PAIR = (TorchFlashKernel, ReferenceKernel)
BUILD = {"cpu": "test", "torch": torch.__version__}
#: what a call may take however the cache is planted (a blocked read never returns)
BOUND_S = 30.0
T = TypeVar("T")


def bounded(fn: Callable[[], T], seconds: float = BOUND_S) -> T:
    """`fn()`, run in a thread: an AssertionError where it has not returned within `seconds`
    (a read blocked on a FIFO would hang the test run, not fail it)."""
    done: list[T] = []
    raised: list[BaseException] = []

    def run() -> None:
        try:
            done.append(fn())
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked: no answer within {seconds} s"
    if raised:
        raise raised[0]
    return done[0]


def fake_measure(kernels: Any, dtype: torch.dtype, *, return_lse: bool) -> calibrate.Calibration:
    """Figures at once: the first kernel fastest, each next one twice its time."""
    seconds = {k.name: dict.fromkeys(calibrate.BATCHES, 1e-3 * 2**i) for i, k in enumerate(kernels)}
    return calibrate.Calibration(seconds, threads=2, cached=False)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ZEN_MLA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ZEN_MLA_CALIBRATE", raising=False)
    monkeypatch.setattr(calibrate, "measure", fake_measure)
    (tmp_path / "cache").mkdir()
    return tmp_path / "cache"


@pytest.fixture
def caplog_warnings(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="zen_mla.attention")
    return caplog


def calibrated() -> calibrate.Calibration:
    return bounded(
        lambda: calibrate.calibrated(KERNEL_PAIR, torch.bfloat16, return_lse=False, build=BUILD)
    )


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- the file as a whole: planted at calibration.json ---------------------------------------


def _deep(path: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000)  # 200 KB: under the cap, past recursion


def _deep_object(path: Path) -> None:
    path.write_text('{"a": ' * 40 + "1" + "}" * 40)  # within recursion, past MAX_DEPTH


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _sparse(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(512 << 20)  # 512 MiB of holes: nothing on disk, all of it to a read


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_text("{}")


def _link(path: Path) -> None:
    """A link to a good cache elsewhere (figures that would be taken, were it followed)."""
    elsewhere = path.parent.parent / "elsewhere.json"
    elsewhere.write_text(_good_file_text())
    path.symlink_to(elsewhere)


def _good_file_text() -> str:
    """A good cache of this test's build, as calibrated() writes it."""
    facts = {
        **BUILD,
        "format": calibrate.FORMAT,
        "kernels": [k.name for k in KERNEL_PAIR],
        "dtype": str(torch.bfloat16),
        "return_lse": False,
    }
    seconds = fake_measure(KERNEL_PAIR, torch.bfloat16, return_lse=False).seconds
    entry = {**facts, "seconds": seconds, "threads": 2, "failed": {}}
    return json.dumps({calibrate._key(facts): entry})


def test_a_good_file_is_taken(cache_dir: Path, caplog_warnings: pytest.LogCaptureFixture):
    """The good cache the link and lock plants stand beside is taken where it is the file."""
    (cache_dir / "calibration.json").write_text(_good_file_text())
    got = calibrated()
    assert got.cached and got.winner == "torch" and not warnings_of(caplog_warnings)


FILE_PLANTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "deep nesting": (_deep, "nests deeper than 8"),
    "deep object": (_deep_object, "nests deeper than 8"),
    "a list": (lambda p: p.write_text("[1, 2]"), "holds a list, not an object of entries"),
    "not utf-8": (lambda p: p.write_bytes(b'{"\xff\xfe": 1}'), "is not JSON"),
    "torn": (lambda p: p.write_text('{"abc": '), "is not JSON"),
    "NaN literal": (lambda p: p.write_text('{"a": NaN}'), "NaN is no number JSON allows"),
    "inf by exponent": (lambda p: p.write_text('{"a": 1e999}'), "a number out of range (inf)"),
    "a FIFO": (_fifo, "is a FIFO, not a regular file"),
    "a symlink to elsewhere": (_link, "is a symbolic link (not followed)"),
    "a 512 MiB sparse file": (_sparse, f"is {512 << 20} bytes, over the cap"),
    "a directory": (_directory, "is a directory, not a regular file"),
}


@pytest.mark.parametrize("plant", FILE_PLANTS, ids=list(FILE_PLANTS))
def test_a_planted_file_is_measured_again_said_and_replaced(
    cache_dir: Path, caplog_warnings: pytest.LogCaptureFixture, plant: str
):
    make, says = FILE_PLANTS[plant]
    path = cache_dir / "calibration.json"
    make(path)
    target = os.readlink(path) if path.is_symlink() else None
    kept_before = Path(target).read_text() if target else None
    start = time.monotonic()
    got = calibrated()
    assert time.monotonic() - start < 5  # no blocking; the fake measures at once
    assert not got.cached and got.winner == "torch"
    said = warnings_of(caplog_warnings)
    assert any(str(path) in w and says in w and "measuring again" in w for w in said), said
    if plant == "a directory":  # nothing can be renamed over a folder: each process measures
        assert path.is_dir() and any("not written" in w for w in said), said
        assert not calibrated().cached
        return
    assert path.is_file() and not path.is_symlink()  # the plant replaced, not followed
    if target is not None:
        assert Path(target).read_text() == kept_before
    assert calibrated().cached  # the good file written in its place is read
    assert sorted(p.name for p in cache_dir.iterdir()) == ["calibration.json", "calibration.lock"]


def test_the_big_file_is_never_read(cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """A file over the cap is refused by its size, before any read."""
    path = cache_dir / "calibration.json"
    _sparse(path)
    reads: list[int] = []
    real_read = os.read

    def spy(fd: int, n: int) -> bytes:
        reads.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", spy)
    assert not calibrated().cached
    assert reads == []  # refused on its fstat'd size alone: not a byte read


def test_a_file_that_grows_past_the_cap_as_it_is_read_costs_the_cap(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """The fstat said small, the file then grew: the read stops at the cap and a byte."""
    monkeypatch.setattr(calibrate, "MAX_CACHE_BYTES", 4096)
    path = cache_dir / "calibration.json"
    path.write_text(" " * (64 << 10))
    real_fstat = os.fstat

    class Small:
        def __init__(self, st: os.stat_result) -> None:
            self.st_mode, self.st_size = st.st_mode, 10

    monkeypatch.setattr(os, "fstat", lambda fd: Small(real_fstat(fd)))
    reads: list[int] = []
    real_read = os.read

    def spy(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        reads.append(len(data))
        return data

    monkeypatch.setattr(os, "read", spy)
    with pytest.raises(calibrate._RefusedError, match="grew over the cap of 4096"):
        calibrate._read_capped(path)
    assert sum(reads) == 4097


RSS_SCRIPT = """
import os, sys
from pathlib import Path
from zen_mla.attention import calibrate

def peak():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

path = Path(sys.argv[1])
before = peak()
calibrate._kept(path, "0" * 16)
print(peak() - before)
"""


@pytest.mark.slow  # a process of its own (torch imported): its peak memory is the file's cost
def test_the_big_file_costs_no_memory(tmp_path: Path):
    path = tmp_path / "calibration.json"
    _sparse(path)
    done = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    grew = int(done.stdout.strip().splitlines()[-1])
    assert grew < 4 << 20, f"the peak RSS grew {grew >> 20} MiB reading a 512 MiB cache"
    assert "over the cap" in done.stderr


# -- an entry of this build with its figures tampered with ----------------------------------


def _tamper(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    kept = json.loads(path.read_text())
    for entry in kept.values():
        change(entry)
    path.write_text(json.dumps(kept))  # NaN and inf as the NaN and Infinity literals


def _seconds(value: Any) -> Callable[[dict[str, Any]], None]:
    def change(entry: dict[str, Any]) -> None:
        entry["seconds"]["torch"]["long"] = value

    return change


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(entry: dict[str, Any]) -> None:
        entry[key] = value

    return change


def _unknown_kernel(entry: dict[str, Any]) -> None:
    entry["seconds"]["evil"] = dict.fromkeys(calibrate.BATCHES, 1e-6)


def _renamed_kernels(entry: dict[str, Any]) -> None:
    entry["kernels"] = ["torch", "evil"]
    entry["seconds"]["evil"] = entry["seconds"].pop("reference")


def _batch_missing(entry: dict[str, Any]) -> None:
    del entry["seconds"]["torch"]["long"]


def _both(entry: dict[str, Any]) -> None:
    entry["failed"] = {"torch": "RuntimeError: no"}


ENTRY_PLANTS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "zero seconds": (_seconds(0), "torch's seconds on long are 0, expected a finite number"),
    "negative seconds": (_seconds(-0.5), "torch's seconds on long are -0.5"),
    "tiny seconds": (_seconds(1e-300), "torch's seconds on long are 1e-300"),
    "huge seconds": (_seconds(1e300), "torch's seconds on long are 1e+300"),
    "NaN seconds": (_seconds(float("nan")), "NaN is no number JSON allows"),
    "inf seconds": (_seconds(float("inf")), "Infinity is no number JSON allows"),
    "seconds as text": (_seconds("0.1"), "torch's seconds on long are '0.1'"),
    "seconds as bool": (_seconds(True), "torch's seconds on long are True"),
    "seconds as null": (_seconds(None), "torch's seconds on long are None"),
    "a batch missing": (_batch_missing, "torch's seconds are not one figure per batch"),
    "seconds a list": (_set("seconds", [1, 2]), "holds no kernel's seconds"),
    "failed a list": (_set("failed", ["torch"]), "'failed' is not an object"),
    "a kernel both": (_both, "either its seconds or what it raised"),
    "an unknown kernel": (_unknown_kernel, "names kernels it was not measured for: ['evil']"),
    "kernels renamed": (_renamed_kernels, "figures of another build"),
    "threads as text": (_set("threads", "2"), "its threads are str, not a whole number"),
    "threads a float": (_set("threads", 2.5), "its threads are float"),
    "zero threads": (_set("threads", 0), "its threads are 0, expected 1 to 65536"),
    "huge threads": (_set("threads", 10**30), "its threads are 1000000000000000000000000000000"),
}


@pytest.mark.parametrize("plant", ENTRY_PLANTS, ids=list(ENTRY_PLANTS))
def test_a_tampered_entry_is_measured_again_said_and_rewritten(
    cache_dir: Path, caplog_warnings: pytest.LogCaptureFixture, plant: str
):
    change, says = ENTRY_PLANTS[plant]
    path = cache_dir / "calibration.json"
    first = calibrated()
    assert not first.cached and calibrated().cached
    _tamper(path, change)
    caplog_warnings.clear()
    got = calibrated()
    assert not got.cached and got.winner == "torch"
    said = warnings_of(caplog_warnings)
    assert any(str(path) in w and says in w and "measuring again" in w for w in said), said
    again = calibrated()  # rewritten: read back whole
    assert again.cached and again.seconds == first.seconds


def test_a_long_failure_is_refused_and_a_measured_one_kept_short(
    cache_dir: Path, caplog_warnings: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    """What a kernel raised goes into /health's reason: a kept one over MAX_FAILURE_CHARS is
    refused, and one measured is cut to it before it is kept."""
    path = cache_dir / "calibration.json"
    calibrated()

    def long_failure(entry: dict[str, Any]) -> None:
        entry["failed"] = {"reference": "RuntimeError: " + "x" * 5000}
        del entry["seconds"]["reference"]

    _tamper(path, long_failure)
    caplog_warnings.clear()
    assert not calibrated().cached
    said = warnings_of(caplog_warnings)
    assert any("what reference raised is not a string of at most 1000" in w for w in said), said


def test_entries_of_other_builds_that_do_not_hold_up_are_dropped_at_the_next_write(
    cache_dir: Path, caplog_warnings: pytest.LogCaptureFixture
):
    path = cache_dir / "calibration.json"
    path.write_text(json.dumps({"0123456789abcdef": {"seconds": 1}, "x": [1]}))
    assert not calibrated().cached
    assert not warnings_of(caplog_warnings)  # not this build's: no measuring for them
    assert any("do not hold up" in r.getMessage() for r in caplog_warnings.records)
    assert len(json.loads(path.read_text())) == 1


def test_a_write_past_the_cap_keeps_the_new_entry_alone(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    path = cache_dir / "calibration.json"
    for torch_version in ("a", "b"):
        build = {**BUILD, "torch": torch_version}
        calibrate.calibrated(KERNEL_PAIR, torch.bfloat16, return_lse=False, build=build)
    assert len(json.loads(path.read_text())) == 2
    monkeypatch.setattr(calibrate, "MAX_CACHE_BYTES", path.stat().st_size + 10)  # not three
    build = {**BUILD, "torch": "c"}
    calibrate.calibrated(KERNEL_PAIR, torch.bfloat16, return_lse=False, build=build)
    assert [e["torch"] for e in json.loads(path.read_text()).values()] == ["c"]


# -- the lock beside it -----------------------------------------------------------------------


def _lock_link(lock: Path) -> None:
    lock.symlink_to(lock.parent.parent / "victim")  # O_CREAT would make the victim


LOCK_PLANTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "a FIFO": (os.mkfifo, "is a FIFO, not a regular file"),
    "a directory": (lambda p: p.mkdir(), "is a directory, not a regular file"),
    "a symlink": (_lock_link, "is a symbolic link (not followed)"),
}


@pytest.mark.parametrize("plant", LOCK_PLANTS, ids=list(LOCK_PLANTS))
def test_a_planted_lock_is_not_used(
    cache_dir: Path, caplog_warnings: pytest.LogCaptureFixture, plant: str
):
    make, says = LOCK_PLANTS[plant]
    lock = cache_dir / "calibration.lock"
    make(lock)
    (cache_dir / "calibration.json").write_text(_good_file_text())
    got = calibrated()
    assert not got.cached and got.winner == "torch"  # no lock, no cache: measured alone
    said = warnings_of(caplog_warnings)
    assert any(str(lock) in w and says in w for w in said), said
    assert not (cache_dir.parent / "victim").exists()


def test_a_lock_held_by_another_is_waited_on_a_bounded_time(
    cache_dir: Path, caplog_warnings: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(calibrate, "LOCK_WAIT_S", 0.3)
    lock = cache_dir / "calibration.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another open: flock conflicts within one process
        start = time.monotonic()
        got = calibrated()
        waited = time.monotonic() - start
    assert not got.cached and 0.3 <= waited < 5
    said = warnings_of(caplog_warnings)
    assert any(str(lock) in w and "held by another over 0.3 s" in w for w in said), said


# -- the selector, and a real service ---------------------------------------------------------

SELECT_PLANTS = [*FILE_PLANTS, "zero seconds"]


@pytest.mark.parametrize("plant", SELECT_PLANTS)
def test_auto_still_resolves_whatever_is_planted(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, plant: str
):
    """host_status() and select_kernel("auto") answer (no exception for /health to report as
    "failed"), in bounded time, a kernel of the registry; where several kernels suit "auto"
    here, the calibration behind it was measured, not taken from the plant."""
    monkeypatch.setattr(auto, "_CALIBRATIONS", {})
    path = cache_dir / "calibration.json"
    if plant in FILE_PLANTS:
        FILE_PLANTS[plant][0](path)
    else:
        bounded(host_status)  # this build's entries, then every figure zeroed
        kept = json.loads(path.read_text())
        for entry in kept.values():
            for times in entry["seconds"].values():
                times.update(dict.fromkeys(times, 0))
        path.write_text(json.dumps(kept))
        monkeypatch.setattr(auto, "_CALIBRATIONS", {})
    status = bounded(host_status)
    assert status.auto_kernel in KERNELS and status.lse_kernel in KERNELS
    for calibration in (status.calibration, status.lse_calibration):
        if calibration is not None:  # None where one kernel suits "auto" here
            assert not calibration.cached
    kernel = bounded(lambda: select.select_kernel("auto", torch.bfloat16, return_lse=False))
    assert kernel.name == status.auto_kernel
    assert bounded(host_kernels)["auto"]["out"]["kernel"] == status.auto_kernel


#: stuck "starting" (a FIFO) and "failed" for good (RecursionError, ZeroDivisionError) before
SERVE_PLANTS = ["a FIFO", "deep nesting", "zero seconds"]


@pytest.mark.slow
@pytest.mark.parametrize("plant", SERVE_PLANTS)
def test_a_service_started_on_a_planted_cache_is_ok_and_answers_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: str
):
    """`zen-mla serve` on a planted ZEN_MLA_CACHE_DIR: /health ok (not "failed", not stuck
    "starting"), the calibration measured, a warning naming the file in its log, and a
    /prefill answered as the fp64 reference says. "zero seconds" is planted for this very
    build (this process's calibration, its figures zeroed): the service finds its entry."""
    from tests.service.servers import serve
    from zen_mla.client import PrefillClient

    cache = tmp_path / "cache"
    cache.mkdir()
    path = cache / "calibration.json"
    if plant == "zero seconds":
        monkeypatch.setenv("ZEN_MLA_CACHE_DIR", str(cache))
        monkeypatch.delenv("ZEN_MLA_CALIBRATE", raising=False)
        monkeypatch.setattr(auto, "_CALIBRATIONS", {})
        if host_status().calibration is None:
            pytest.skip('one kernel suits "auto" here: no calibration is read')
        kept = json.loads(path.read_text())
        for entry in kept.values():
            for times in entry["seconds"].values():
                times.update(dict.fromkeys(times, 0))
        path.write_text(json.dumps(kept))
        says = "(this build's) "
    else:
        FILE_PLANTS[plant][0](path)
        says = FILE_PLANTS[plant][1]
    with serve(tmp_path, workers=1, cache_dir=str(cache), calibrate="1") as server:
        health = server.health()
        assert health["status"] == "ok", health
        calibration = health["kernels"]["auto"]["out"]["calibration"]
        if calibration is not None:
            assert not calibration["cached"]
            assert all(t > 0 for v in calibration["seconds"].values() for t in v.values())
            assert f"calibration cache {path}: " in server.logs()
            assert says in server.logs()
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(48, 4, 192, generator=gen).bfloat16()
        k = torch.randn(48, 4, 192, generator=gen).bfloat16()
        v = torch.randn(48, 4, 128, generator=gen).bfloat16()
        q_cu = torch.tensor([0, 16, 48], dtype=torch.int32)
        with PrefillClient(server.url) as client:
            out, lse = client.prefill(q, k, v, q_cu, return_lse=True)
        assert_close_to_reference(q, k, v, q_cu, q_cu, True, out, lse)
