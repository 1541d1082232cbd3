"""What tests read of processes, and how they wait: descriptors, resident memory, and a
condition polled until it holds (never a sleep that guesses how long something takes). No
pytest here: the benchmarks wait with `wait_for` too (bench/_server.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def open_fds(pid: int | str = "self") -> int:
    """Descriptors process `pid` holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss(pid: int) -> int:
    """Process `pid`'s resident memory, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _poll(done: Callable[[], T], seconds: float, step: float) -> T | None:
    """`done()`'s first truthy value within `seconds` (polled every `step`); None past them."""
    end = time.monotonic() + seconds
    while not (value := done()):
        if time.monotonic() > end:
            return None
        time.sleep(step)
    return value


def eventually(done: Callable[[], object], seconds: float = 2.0, step: float = 0.01) -> bool:
    """Whether `done()` holds within `seconds` (polled every `step`)."""
    return _poll(done, seconds, step) is not None


def wait_for(
    predicate: Callable[[], T],
    seconds: float,
    what: str | Callable[[], str],
    step: float = 0.05,
) -> T:
    """`predicate()`'s first truthy value, polled every `step`; past `seconds`, an
    AssertionError (the test fails) saying `what`, or what `what()` says then where it is a
    function (the state waited on, as it was at the end)."""
    value = _poll(predicate, seconds, step)
    if value is None:
        raise AssertionError(what() if callable(what) else what)
    return value
