"""A RegionServer on an event loop of its own in this process, and raw clients of its socket,
for the region socket's tests (no service process); and what a region costs whom: holes
punched in a memfd, the memory it holds, and which processes map it."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from zen_mla import UnauthorizedError
from zen_mla.pool import SharedBuffer
from zen_mla.regions.protocol import recv_frame
from zen_mla.regions.registry import RegionRegistry
from zen_mla.regions.server import Authorize, RegionServer

T = TypeVar("T")


class Running:
    def __init__(self, server: RegionServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.loop = server, loop

    def on_loop(self, fn: Callable[[], T]) -> T:
        """`fn()` run on the server's loop (its state is that thread's)."""

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(5)

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(self.server.path)
        return s


def token_check(token: str) -> Authorize:
    """The check of one shared token, naming no one (as the service's without tenants)."""

    def check(given: str | None) -> None:
        if given is None or not hmac.compare_digest(given.encode(), token.encode()):
            raise UnauthorizedError("a valid bearer token is required")

    return check


@contextlib.contextmanager
def running(tmp: Path, token: str | None = None, **limits: Any) -> Iterator[Running]:
    """A RegionServer at `tmp`/regions.sock with `limits` (RegionServer's keywords; max_clients
    8 unless given), serving until the block ends."""
    registry = RegionRegistry(max_regions=4, max_bytes=1 << 30, adopt=SharedBuffer.adopt)
    limits.setdefault("max_clients", 8)
    check = None if token is None else token_check(token)
    server = RegionServer(
        str(tmp / "regions.sock"), registry, authorize=check, instance="x", **limits
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = Running(server, loop)
    try:
        run.on_loop(server.start)
        yield run
    finally:
        run.on_loop(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def refused(s: socket.socket) -> tuple[int, float]:
    """The refusal's status and how long it took to come, once the server closed `s` after
    it."""
    t0 = time.monotonic()
    reply = recv_frame(s)
    assert not reply["ok"], reply
    try:
        rest = s.recv(1)
    except ConnectionResetError:  # closed with bytes of ours unread: a reset, on Unix sockets
        rest = b""
    assert rest == b"", "the connection stayed open after a refusal"
    return int(reply["status"]), time.monotonic() - t0


_libc = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02  # <linux/falloc.h>


def punch_hole(fd: int, offset: int, nbytes: int) -> None:
    """Give the memory of bytes `[offset, offset + nbytes)` of `fd` back (they read as zeros,
    and the next touch faults a new page in): what F_SEAL_SHRINK does not stop."""
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _libc.fallocate(fd, mode, ctypes.c_long(offset), ctypes.c_long(nbytes)):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def allocate_past_end(fd: int, nbytes: int) -> None:
    """Pages for `nbytes` past the end of `fd`, its size kept (fallocate with KEEP_SIZE): memory
    the file holds (`held_bytes`) that no mapping of its size reaches."""
    end = os.fstat(fd).st_size
    if _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, ctypes.c_long(end), ctypes.c_long(nbytes)):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def held_bytes(fd: int) -> int:
    """The memory the file behind `fd` holds (its pages, written or fallocated), past its end
    too."""
    return os.fstat(fd).st_blocks * 512


class _Range(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _CacheStat(ctypes.Structure):
    _fields_ = tuple((n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "r"))


def inside_bytes(fd: int) -> int:
    """The memory behind the bytes of `fd` up to its size (its pages there, written or
    fallocated, in memory or swapped out): `cachestat` (Linux 6.5) over that range."""
    where, stat = _Range(0, max(os.fstat(fd).st_size, 1)), _CacheStat()
    if _libc.syscall(451, fd, ctypes.byref(where), ctypes.byref(stat), 0):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(stat.cache + stat.evicted) * os.sysconf("SC_PAGE_SIZE")


def service_pids(pid: int) -> list[int]:
    """A server process and its children (the workers)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [pid, *map(int, out.split())]


def mapping(pid: int, name: str) -> bool:
    """Process `pid` maps a memfd called `name`."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(f"/memfd:{name} " in line for line in f)
    except FileNotFoundError:
        return False


def maps_memfd(pid: int, fd: int) -> bool:
    """Process `pid` maps the memfd `fd` names (by its inode: other memfds of the same name,
    left by other tests, do not count)."""
    inode = str(os.fstat(fd).st_ino)
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(
                len(parts) > 5 and parts[4] == inode and parts[5].startswith("/memfd:")
                for parts in (line.split() for line in f)
            )
    except FileNotFoundError:
        return False


def holding(pid: int, name: str) -> bool:
    """Process `pid` has a descriptor of a memfd called `name`."""
    with contextlib.suppress(FileNotFoundError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{name} "):
                    return True
    return False
