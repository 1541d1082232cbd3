"""One worker process and its pipe: spawn it, wait until it is ready, send it messages with
descriptors attached, stop it.

A message and the descriptors it carries (`SCM_RIGHTS`) leave in one `sendmsg` on the socket
`multiprocessing.Pipe` made, framed as `Connection.send` frames them, and nothing on this side
allocates a descriptor to send: `multiprocessing.reduction.send_handle` dups the socket for each
descriptor, and when this process has none left that failed, the dispatcher took it for the
worker's death and killed a healthy worker. A `sendmsg` either queues the whole message (a few
KiB; the socket buffer holds far more) or fails having sent nothing, so a failed send leaves the
worker waiting for its next message as before.
"""

from __future__ import annotations

import array
import contextlib
import errno
import logging
import multiprocessing as mp
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait

from ..errors import KernelError
from . import _worker
from ._messages import Ready, Stop, ToSupervisor, ToWorker
from .topology import WorkerSlot

__all__ = ["SendFailedError", "WorkerGoneError", "WorkerProcess", "start_until_ready"]

log = logging.getLogger("zen_mla.pool")
_spawn = mp.get_context("spawn")
_env_lock = threading.Lock()
#: what a worker's environment sets (its thread counts) and leaves to OpenMP's default
_THREAD_COUNTS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_WORKER_ENV = (*_THREAD_COUNTS, "OMP_WAIT_POLICY")
#: seconds between attempts to start a worker: the first, and the cap it doubles to
START_BACKOFF = (0.1, 5.0)
#: errors of a send that say the other end is gone, not that this process lacked a resource
_PEER_GONE = {errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF}


class SendFailedError(Exception):
    """Nothing was sent (no memory, no buffer space...): the worker is as it was."""


class WorkerGoneError(Exception):
    """The worker's end of the pipe is closed, or a message went out in part only."""


class WorkerProcess:
    """A spawned worker pinned to `slot`'s CPUs and the parent end of its pipe.

    Spawn from a thread that lives as long as the worker (the pool's spawner thread): workers
    ask for SIGKILL when the thread that started them exits (`PR_SET_PDEATHSIG` follows the
    parent thread, not the parent process).
    """

    def __init__(self, slot: WorkerSlot, warm_zentorch: bool, heartbeat_interval: float) -> None:
        parent, child = _spawn.Pipe(duplex=True)
        try:
            # spawn runs the parent's __main__ module again in the child (as __mp_main__)
            # before `_worker.main`: a script that imports torch at its top (bench/pool.py,
            # most users' scripts) loads it there, and OpenMP reads OMP_NUM_THREADS when it
            # loads, before `_worker.main` could set it. So the child starts with the thread
            # counts in its environment. (The entry point's own import chain loads no torch:
            # tests/pool/test_pool_imports.py.) _env_lock: os.environ is one per process.
            # A worker owns its cores: its OpenMP threads wait for the next call spinning a
            # while before they sleep (OpenMP's default), whatever wait policy the parent
            # chose for itself. A parent that set OMP_WAIT_POLICY=PASSIVE so as not to spin on
            # the server's cores (a benchmark, an orchestrator) made every small call wake
            # the worker's threads from sleep: 0.1-0.2 ms more a call here.
            with _env_lock:
                saved = {v: os.environ.get(v) for v in _WORKER_ENV}
                os.environ.update({v: str(slot.threads) for v in _THREAD_COUNTS})
                os.environ.pop("OMP_WAIT_POLICY", None)
                try:
                    self.process = _spawn.Process(
                        target=_worker.main,
                        args=(
                            child,
                            os.getpid(),
                            slot.cpus,
                            slot.threads,
                            warm_zentorch,
                            heartbeat_interval,
                        ),
                        name=f"zen-mla-worker-{slot.id}",
                        daemon=True,
                    )
                    self.process.start()
                finally:
                    for v, old in saved.items():
                        if old is None:
                            os.environ.pop(v, None)
                        else:
                            os.environ[v] = old
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.slot = slot
        self.conn: Connection = parent
        self.pid: int = self.process.pid or 0
        self._closed = False

    @property
    def sentinel(self) -> int:
        return int(self.process.sentinel)

    def is_alive(self) -> bool:
        return not self._closed and self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def recv(self) -> ToSupervisor:
        """The worker's next message (blocks); EOFError or OSError once its end is closed."""
        msg: ToSupervisor = self.conn.recv()
        return msg

    def wait_ready(self, deadline: float, cancelled: threading.Event) -> None:
        """Wait for the worker's `Ready` (it has loaded torch); KernelError if it exits, says
        anything else, or is not ready by `deadline` (or `cancelled` is set)."""
        while not cancelled.is_set() and time.monotonic() < deadline:
            ready = wait([self.conn, self.sentinel], min(0.2, deadline - time.monotonic()))
            if self.conn in ready:
                try:
                    msg: ToSupervisor | None = self.recv()
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, Ready):
                    return
                break
            if self.sentinel in ready:
                break
        raise KernelError(
            f"worker {self.slot.id} on CPUs {list(self.slot.cpus)} did not start"
            f" (exit code {self.process.exitcode})"
        )

    def send(self, msg: ToWorker, fds: Sequence[int] = ()) -> None:
        """Send `msg` with `fds` attached. SendFailedError: nothing went out; WorkerGoneError:
        the worker is gone or the pipe is out of step (part of a message went out)."""
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        data = struct.pack("!i", len(payload)) + payload
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        # a socket object over the pipe's own descriptor: no dup, so no descriptor to run out of
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, self.conn.fileno())
        try:
            try:
                sent = sock.sendmsg([data], ancillary)
            except OSError as exc:
                if exc.errno in _PEER_GONE:
                    raise WorkerGoneError(str(exc)) from exc
                raise SendFailedError(f"{exc.strerror or exc} (errno {exc.errno})") from exc
            if sent < len(data):
                try:
                    sock.sendall(data[sent:])
                except OSError as exc:
                    raise WorkerGoneError(f"message sent in part: {exc}") from exc
        finally:
            sock.detach()

    def kill(self) -> None:
        if not self._closed:
            self.process.kill()

    def stop(self) -> None:
        """Ask the worker to exit, kill it if it does not within 2 s, free the pipe."""
        if self._closed:
            return
        if self.process.is_alive():
            with contextlib.suppress(SendFailedError, WorkerGoneError):
                self.send(Stop())
            self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()
        self._closed = True
        if self.process.exitcode is not None:
            self.process.close()


def start_until_ready(
    start: Callable[[], WorkerProcess], timeout: float, closed: threading.Event, name: str
) -> WorkerProcess | None:
    """`start()` a worker until one is ready (each within `timeout` s), waiting 0.1 s doubling to
    5 s between attempts (out of descriptors, memory or processes is not permanent); None once
    `closed` is set. Every failure is logged."""
    backoff = START_BACKOFF[0]
    while not closed.is_set():
        try:
            proc = start()
        except Exception as exc:  # EMFILE, ENOMEM, EAGAIN... or the spawner shut down
            log.warning("%s: could not spawn a replacement: %r", name, exc)
        else:
            try:
                proc.wait_ready(time.monotonic() + timeout, closed)
                return proc
            except KernelError as exc:
                log.warning("%s: the replacement did not start: %s", name, exc)
                proc.stop()
        closed.wait(backoff)
        backoff = min(backoff * 2, START_BACKOFF[1])
    return None
