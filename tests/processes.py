"""What tests read of processes, and how they wait: descriptors, resident memory, and a
condition polled until it holds (never a sleep that guesses how long something takes)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def open_fds(pid: int | str = "self") -> int:
    """Descriptors process `pid` holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss(pid: int) -> int:
    """Process `pid`'s resident memory, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def eventually(done: Callable[[], object], seconds: float = 2.0, step: float = 0.01) -> bool:
    """Whether `done()` holds within `seconds` (polled every `step`)."""
    end = time.monotonic() + seconds
    while not done():
        if time.monotonic() > end:
            return False
        time.sleep(step)
    return True


def wait_for(predicate: Callable[[], object], seconds: float, what: str) -> None:
    """Returns once `predicate()` holds; fails the test with `what` past `seconds`."""
    assert eventually(predicate, seconds, 0.05), what
