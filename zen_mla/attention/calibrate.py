"""How fast each kernel "auto" may take is on this host: a short calibration (a fraction of a
second) of scaled-down forms of the contract's batches, the kernels timed interleaved, kept on
disk per host and build, so that every process of the host (the service, its workers, vLLM's)
takes the same kernel without measuring again.

`ZEN_MLA_CALIBRATE=0` turns it off ("auto" then takes the first suitable kernel in order of
preference); `ZEN_MLA_CACHE_DIR` names where the results are kept (default
`$XDG_CACHE_HOME/zen-mla`, else `~/.cache/zen-mla`; where it cannot be written, each process
measures for itself).

The cache is untrusted input: whoever can write its folder can plant anything there. It is read
only where it is a regular file of at most `MAX_CACHE_BYTES` (opened without following a link
and without blocking: a FIFO or a device is refused, never read), its JSON at most `MAX_DEPTH`
deep, and every figure of an entry checked (the kernels and batches expected, finite seconds in
`SECONDS_RANGE`, a whole count of threads, the build the entry is filed under). Anything else is
measured again, with a warning naming the file and what was wrong with it, and replaced on the
next write (atomic: a new file renamed over the old, whatever stood there). A lock held too
long (`LOCK_WAIT_S`) is not waited on past that: the process measures for itself. What a
planted cache can still do is pick which of the kernels that passed their probes "auto" takes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.metadata
import itertools
import json
import logging
import math
import os
import stat
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..envs import ZEN_MLA_CACHE_DIR, ZEN_MLA_CALIBRATE
from .batch import RaggedBatch, random_batch
from .driver import attend
from .host import HostFacts
from .kernels import AttentionKernel
from .kernels.native import native_isa, native_module

__all__ = [
    "BATCHES",
    "Calibration",
    "build_facts",
    "cache_path",
    "calibrated",
    "calibration_enabled",
]

log = logging.getLogger("zen_mla.attention")

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
#: the cache file's size cap (an entry is ~1 KiB): a larger file is not read, and where the
#: entries kept would pass it, a write keeps the new one only
MAX_CACHE_BYTES = 256 << 10
#: the cache's JSON nesting at most (an entry's CPU facts sit at 3)
MAX_DEPTH = 8
#: a kept figure, in seconds, is taken where it lies in this range (a calibration batch takes
#: microseconds to seconds), else the entry is measured again
SECONDS_RANGE = (1e-9, 3600.0)
#: a kept count of threads is taken where it lies in this range
THREADS_RANGE = (1, 1 << 16)
#: what a kernel raised, kept at most this long (it goes into /health's reason)
MAX_FAILURE_CHARS = 1000
#: how long a process waits for the lock of another measuring (a fraction of a second, some
#: seconds on a busy host) before it measures for itself, the cache left alone
LOCK_WAIT_S = 30.0


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
    builds of torch, zentorch, zen-mla and its native extension, and the path the extension
    takes."""
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
        # a path forced with ZEN_MLA_NATIVE_ISA is measured apart from the CPU's own
        "native_path": native_isa() if module is not None else None,
    }


def calibration_enabled() -> bool:
    """False where `ZEN_MLA_CALIBRATE` is 0, false, no or off."""
    return ZEN_MLA_CALIBRATE.read()


def cache_path() -> Path:
    """The file the calibrations are kept in."""
    base = ZEN_MLA_CACHE_DIR.read() or os.path.join(
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
                failed[kernel.name] = f"{type(exc).__name__}: {exc}"[:MAX_FAILURE_CHARS]
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


def _warn(path: Path, what: str) -> None:
    log.warning("calibration cache %s: %s; measuring again", path, what)


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "of an unknown kind"


class _RefusedError(Exception):
    """What stands at a path of the cache is not a regular file (or is a link): not used."""


def _open_regular(path: Path, flags: int) -> int:
    """`path` opened where it is a regular file, without following a link at it and without
    blocking (a FIFO opens at once, and is refused). FileNotFoundError where there is none,
    _RefusedError where it is a link or no regular file, another OSError where it cannot be
    opened."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _RefusedError("is a symbolic link (not followed)") from None
        if exc.errno == errno.EISDIR:
            raise _RefusedError("is a directory, not a regular file") from None
        if exc.errno == errno.ENXIO:  # a socket, or a device with nothing behind it
            raise _RefusedError("is not a regular file") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _RefusedError(f"is {_kind(mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _acquire(fd: int, lock: Path) -> bool:
    """An exclusive flock on `fd` within `LOCK_WAIT_S`; False past it (a stuck or planted
    holder keeps no process from starting)."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                log.warning(
                    "calibration cache lock %s: held by another over %g s; measuring without "
                    "the cache",
                    lock,
                    LOCK_WAIT_S,
                )
                return False
            time.sleep(0.01)
        except OSError:
            return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """Holds an exclusive lock beside `path` (the processes of one host measure one at a time,
    the others then read); yields False where the folder cannot be made or locked, the lock is
    no regular file, or another holds it past `LOCK_WAIT_S`."""
    lock = path.with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_regular(lock, os.O_RDWR | os.O_CREAT)
    except _RefusedError as exc:
        log.warning("calibration cache lock %s: %s; measuring without the cache", lock, exc)
        yield False
        return
    except OSError:  # a folder that cannot be written: each process measures for itself
        yield False
        return
    try:
        yield _acquire(fd, lock)
    finally:
        os.close(fd)


def _read_capped(path: Path) -> bytes | None:
    """The cache file's bytes, None where there is none. _RefusedError where it is no regular
    file or over `MAX_CACHE_BYTES` (then never read whole: at most the cap and a byte),
    OSError where it cannot be read."""
    try:
        fd = _open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_CACHE_BYTES:
            raise _RefusedError(f"is {size} bytes, over the cap of {MAX_CACHE_BYTES}")
        chunks, got = [], 0
        while got <= MAX_CACHE_BYTES:  # it may grow after the fstat
            chunk = os.read(fd, MAX_CACHE_BYTES + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > MAX_CACHE_BYTES:
            raise _RefusedError(f"grew over the cap of {MAX_CACHE_BYTES} bytes as it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no number JSON allows")


def _plain(value: Any, limit: int) -> str | None:
    """What is wrong with parsed JSON: nesting over `limit` deep, or a float that is not
    finite (1e999); None where nothing is. Walks without recursion."""
    stack = [iter((value,))]
    while stack:
        for item in stack[-1]:
            if isinstance(item, float) and not math.isfinite(item):
                return f"holds a number out of range ({item})"
            if isinstance(item, (dict, list)):
                if len(stack) > limit:
                    return f"nests deeper than {limit}"
                stack.append(iter(item.values() if isinstance(item, dict) else item))
                break
        else:
            stack.pop()
    return None


def _key(facts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def _seconds_ok(value: Any) -> bool:
    low, high = SECONDS_RANGE
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and low <= value <= high
    )


def _entry_problem(key: str, entry: Any) -> str | None:
    """What is wrong with a kept entry, None where nothing is: it holds the facts it is filed
    under (their hash is `key`), its kernels' names, each kernel's seconds for every batch
    (finite, in `SECONDS_RANGE`) or what it raised, and a count of threads."""
    if not isinstance(entry, dict):
        return f"is {type(entry).__name__}, not an object"
    figures = {"seconds", "threads", "failed"}
    if not figures <= entry.keys():
        return f"lacks {sorted(figures - entry.keys())}"
    facts = {k: v for k, v in entry.items() if k not in figures}
    if _key(facts) != key:
        return "holds figures of another build than the one it is filed under"
    kernels, seconds, failed, threads = (
        facts.get("kernels"),
        entry["seconds"],
        entry["failed"],
        entry["threads"],
    )
    if not (
        isinstance(kernels, list)
        and kernels
        and all(isinstance(k, str) for k in kernels)
        and len(set(kernels)) == len(kernels)
    ):
        return "names no list of kernels"
    if not isinstance(seconds, dict) or not seconds:
        return "holds no kernel's seconds"
    if not isinstance(failed, dict):
        return "'failed' is not an object"
    unknown = (set(seconds) | set(failed)) - set(kernels)
    if unknown:
        return f"names kernels it was not measured for: {sorted(unknown)[:4]}"
    if set(seconds) & set(failed) or len(seconds) + len(failed) != len(kernels):
        return "does not say for each kernel either its seconds or what it raised"
    for name, times in seconds.items():
        if not isinstance(times, dict) or set(times) != set(BATCHES):
            return f"{name}'s seconds are not one figure per batch ({', '.join(BATCHES)})"
        for batch, value in times.items():
            if not _seconds_ok(value):
                low, high = SECONDS_RANGE
                return (
                    f"{name}'s seconds on {batch} are {value!r:.40}, expected a finite "
                    f"number in [{low:g}, {high:g}]"
                )
    for name, why in failed.items():
        if not isinstance(why, str) or len(why) > MAX_FAILURE_CHARS:
            return f"what {name} raised is not a string of at most {MAX_FAILURE_CHARS} characters"
    low_t, high_t = THREADS_RANGE
    if not (isinstance(threads, int) and not isinstance(threads, bool)):
        return f"its threads are {type(threads).__name__}, not a whole number"
    if not low_t <= threads <= high_t:
        return f"its threads are {threads}, expected {low_t} to {high_t}"
    return None


def _load(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The cache's entries that hold up (`_entry_problem`), and what is wrong with each that
    does not. Nothing is taken on trust: _RefusedError says what is wrong with the file as a
    whole (no file: no entries), and no other error is raised but OSError."""
    raw = _read_capped(path)
    if raw is None:
        return {}, {}
    try:
        kept = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise _RefusedError(f"nests deeper than {MAX_DEPTH}") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError among them
        raise _RefusedError(f"is not JSON ({str(exc)[:120]})") from None
    if not isinstance(kept, dict):
        raise _RefusedError(f"holds a {type(kept).__name__}, not an object of entries")
    why = _plain(kept, MAX_DEPTH)
    if why is not None:
        raise _RefusedError(why)
    entries: dict[str, dict[str, Any]] = {}
    problems: dict[str, str] = {}
    for key, entry in kept.items():
        problem = _entry_problem(key, entry)
        if problem is None:
            entries[key] = entry
        else:
            problems[key] = problem
    return entries, problems


def _write(path: Path, kept: dict[str, dict[str, Any]], key: str) -> None:
    """`kept` (entries that held up, and `key`'s new one) written to a new file in the cache's
    folder, flushed, and renamed over `path`: a reader sees the old file or the new one, and a
    link or FIFO planted at `path` is replaced, not followed. Where all of them would pass
    `MAX_CACHE_BYTES`, `key`'s entry alone is kept."""
    tmp = None
    try:
        text = json.dumps(kept, indent=1, sort_keys=True, allow_nan=False)
        if len(text) > MAX_CACHE_BYTES:
            text = json.dumps({key: kept[key]}, indent=1, sort_keys=True, allow_nan=False)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except (OSError, ValueError) as exc:
        log.warning("calibration cache %s: not written (%s)", path, exc)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


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
    key = _key(facts)
    path = cache_path()
    with _locked(path) as shared:
        kept: dict[str, dict[str, Any]] = {}
        if shared:
            kept = _kept(path, key)
        entry = kept.get(key)
        if entry is not None:
            return Calibration(entry["seconds"], entry["threads"], True, entry["failed"])
        done = measure(kernels, dtype, return_lse=return_lse)
        if shared:
            kept[key] = {
                **facts,
                "seconds": done.seconds,
                "threads": done.threads,
                "failed": done.failed,
            }
            _write(path, kept, key)
    return done


def _kept(path: Path, key: str) -> dict[str, dict[str, Any]]:
    """The cache's entries that hold up; a warning naming the file and what is wrong where the
    file does not, or `key`'s entry does not (it is measured again)."""
    try:
        kept, problems = _load(path)
    except _RefusedError as exc:
        _warn(path, str(exc))
        return {}
    except OSError as exc:
        _warn(path, f"cannot be read ({exc.strerror or exc})")
        return {}
    if key in problems:
        _warn(path, f"its entry {key} (this build's) {problems.pop(key)}")
    if problems:  # dropped at the next write
        log.info("calibration cache %s: entries that do not hold up: %s", path, problems)
    return kept
