"""How fast each kernel "auto" may take is on this host: a short calibration (a fraction of a
second) of scaled-down forms of the contract's batches, the kernels timed interleaved, kept on
disk per host and build, so that every process of the host (the service, its workers, vLLM's)
takes the same kernel without measuring again.

`ZEN_MLA_CALIBRATE=0` turns it off ("auto" then takes the first suitable kernel in order of
preference); `ZEN_MLA_CACHE_DIR` names where the results are kept (default
`$XDG_CACHE_HOME/zen-mla`, else `~/.cache/zen-mla`; where it cannot be written, each process
measures for itself).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .batch import RaggedBatch, random_batch
from .driver import attend
from .host import HostFacts
from .kernels import AttentionKernel
from .kernels.native import native_module

__all__ = [
    "BATCHES",
    "Calibration",
    "build_facts",
    "cache_path",
    "calibrated",
    "calibration_enabled",
]

#: (query lengths, key lengths, causal) of the calibration's batches: the contract's `long`,
#: `mixed`, `short` and `chunk` at a quarter of their tokens, 8 heads of MLA's head dims
BATCHES = {
    "long": ([1024], [1024], True),
    "mixed": ([512, 256, 128, 64], [512, 256, 128, 64], True),
    "short": ([64] * 16, [64] * 16, True),
    "chunk": ([128] * 2, [1024] * 2, False),
}
HEADS, QK_HEAD_DIM, V_HEAD_DIM = 8, 192, 128
#: timed rounds after a warm-up; each kernel's time of a batch is the median of its rounds
ROUNDS = 3
#: the cache's format: results of another format are measured again
FORMAT = 1


@dataclass(frozen=True, slots=True)
class Calibration:
    """The kernels' median seconds per batch, and the winner: the kernel with the least
    geometric mean over the batches of its time over the fastest's."""

    seconds: dict[str, dict[str, float]]
    threads: int
    cached: bool
    #: the kernels that raised on a calibration batch (left out), and what they raised
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def relative(self) -> dict[str, float]:
        """Each kernel's time over the fastest's, the geometric mean over the batches."""
        best = {b: min(times[b] for times in self.seconds.values()) for b in BATCHES}
        return {
            name: math.exp(statistics.fmean(math.log(times[b] / best[b]) for b in BATCHES))
            for name, times in self.seconds.items()
        }

    @property
    def winner(self) -> str:
        relative = self.relative
        return min(relative, key=relative.__getitem__)

    def reason(self) -> str:
        """Which kernel won and by how much, in words for `/health`."""
        relative = self.relative
        winner = self.winner
        others = ", ".join(
            f"{name} {relative[name] / relative[winner]:.2f}x its time"
            for name in sorted(relative, key=relative.__getitem__)
            if name != winner
        )
        failed = "".join(f"; {name} raised on it: {why}" for name, why in self.failed.items())
        return (
            f"{winner} measured fastest here ({others}{', ' * bool(others)}geometric mean over "
            f"{', '.join(BATCHES)} at {HEADS} heads, {self.threads} threads"
            f"{', kept from an earlier run' * self.cached}{failed})"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the winner, each kernel's relative time, and its seconds per batch."""
        return {
            "winner": self.winner,
            "relative": {k: round(v, 3) for k, v in self.relative.items()},
            "seconds": {k: {b: round(t, 6) for b, t in v.items()} for k, v in self.seconds.items()},
            "threads": self.threads,
            "cached": self.cached,
            "failed": self.failed,
        }


def build_facts(host: HostFacts) -> dict[str, Any]:
    """What a calibration's figures hold for: the CPU and the host's count of them, and the
    builds of torch, zentorch, zen-mla and its native extension."""
    module = native_module()[0] if host.native_failure is None else None
    stat = os.stat(module.__file__) if module is not None and module.__file__ else None
    try:
        ours = importlib.metadata.version("zen-mla")
    except importlib.metadata.PackageNotFoundError:
        ours = None
    return {
        "cpu": asdict(host.cpu),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "zentorch": host.zentorch_version,
        "zen_mla": ours,
        "native": [stat.st_size, stat.st_mtime_ns] if stat else None,
    }


def calibration_enabled() -> bool:
    """False where `ZEN_MLA_CALIBRATE` is 0, false, no or off."""
    said = os.environ.get("ZEN_MLA_CALIBRATE", "1").strip().lower()
    return said not in {"0", "false", "no", "off"}


def cache_path() -> Path:
    """The file the calibrations are kept in."""
    base = os.environ.get("ZEN_MLA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zen-mla"
    )
    return Path(base) / "calibration.json"


def _batch(name: str, dtype: torch.dtype) -> RaggedBatch:
    q_lens, kv_lens, causal = BATCHES[name]
    heads = (HEADS, QK_HEAD_DIM, V_HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    return random_batch(q_lens, kv_lens, heads, dtype, causal=causal, gen=gen)


def measure(
    kernels: Sequence[type[AttentionKernel]], dtype: torch.dtype, *, return_lse: bool
) -> Calibration:
    """Time each kernel on each batch: a warm-up call each, then `ROUNDS` rounds in which every
    kernel runs every batch once, one after another (a noisy neighbour hits all alike); a kernel
    that took over twice the fastest's time on every batch of the first round runs no more."""
    batches = {name: _batch(name, dtype) for name in BATCHES}

    def once(kernel: type[AttentionKernel], batch: RaggedBatch) -> float:
        start = time.perf_counter()
        attend(batch, kernel, return_lse=return_lse)
        return time.perf_counter() - start

    failed: dict[str, str] = {}
    for kernel, batch in itertools.product(kernels, batches.values()):
        if kernel.name not in failed:
            try:
                once(kernel, batch)
            except Exception as exc:  # passed its probe, yet raised: not a candidate
                failed[kernel.name] = f"{type(exc).__name__}: {exc}"
    running = [k for k in kernels if k.name not in failed]
    if not running:
        raise RuntimeError(f"every kernel raised in the calibration: {failed}")
    times: dict[str, dict[str, list[float]]] = {k.name: {b: [] for b in BATCHES} for k in running}
    for round_ in range(ROUNDS):
        for kernel, (name, batch) in itertools.product(running, batches.items()):
            times[kernel.name][name].append(once(kernel, batch))
        if round_ == 0:  # a kernel over twice the fastest's time on every batch is out
            best = {b: min(ts[b][0] for ts in times.values()) for b in BATCHES}
            running = [
                k for k in running if any(times[k.name][b][0] < 2 * best[b] for b in BATCHES)
            ]
    seconds = {k: {b: statistics.median(ts) for b, ts in v.items()} for k, v in times.items()}
    return Calibration(seconds, torch.get_num_threads(), cached=False, failed=failed)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """Holds an exclusive lock beside `path` (the processes of one host measure one at a time,
    the others then read); yields False where the folder cannot be made or locked."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)


def _read(path: Path) -> dict[str, Any]:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def _write(path: Path, kept: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-")
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def calibrated(
    kernels: Sequence[type[AttentionKernel]],
    dtype: torch.dtype,
    *,
    return_lse: bool,
    build: dict[str, Any],
) -> Calibration:
    """The calibration of `kernels` for `dtype` inputs, kept on disk under what the host and
    the build are (`build`: `build_facts`, the CPU, torch's, zentorch's and zen-mla's versions,
    the native extension's file), measured now where none is kept."""
    facts = {
        **build,
        "format": FORMAT,
        "kernels": [k.name for k in kernels],
        "dtype": str(dtype),
        "return_lse": return_lse,
    }
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_path()
    with _locked(path) as shared:
        entry = _read(path).get(key) if shared else None
        if isinstance(entry, dict) and isinstance(entry.get("seconds"), dict):
            seconds, failed = entry["seconds"], entry.get("failed", {})
            if (
                seconds
                and isinstance(failed, dict)
                and set(seconds) | set(failed) == {k.name for k in kernels}
                and all(set(v) == set(BATCHES) for v in seconds.values())
            ):
                return Calibration(seconds, int(entry.get("threads", 0)), True, failed)
        done = measure(kernels, dtype, return_lse=return_lse)
        if shared:
            kept = _read(path)
            kept[key] = {
                **facts,
                "seconds": done.seconds,
                "threads": done.threads,
                "failed": done.failed,
            }
            _write(path, kept)
    return done
