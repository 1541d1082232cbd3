"""The worker process: pinned to its CPUs, it runs attention pieces on shared-memory tensors.

Unpickling the spawn target imports this module, `zen_mla` and `zen_mla.pool` (both lazy) and
`_messages`, none of which loads torch: `main` sets the CPU affinity and thread environment
first, then imports torch (tests/pool/test_pool_imports.py checks the chain).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import mmap
import os
import pickle
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import Any, cast

from ..errors import InvalidInputError, parts_of
from ._messages import (
    Done,
    Failed,
    Forget,
    Heartbeat,
    Latent,
    Ready,
    RunTask,
    Stop,
    TaskSpec,
    TensorRef,
    ToSupervisor,
)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: descriptors one message may carry: a task names up to four buffers it has not mapped yet
#: (inputs that may lie in up to three, and its outputs), with room to spare
MAX_FDS = 8
#: how often the watchdog looks for its parent, in seconds
WATCH_INTERVAL = 0.2
#: tensor views kept across tasks (`_Mapped`): an orchestrator's layers name a few each
VIEWS_KEPT = 64


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that spawned it exits; exit now if the parent died
    before prctl, which nothing would tell us about."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _setup(cpus: tuple[int, ...], threads: int) -> None:
    os.sched_setaffinity(0, cpus)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ZENDNN_NUM_THREADS"):
        os.environ[var] = str(threads)


class _Sender:
    """The worker's sending end, shared by the main thread (answers) and the watchdog thread
    (heartbeats); `lock` keeps their messages whole."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: ToSupervisor) -> None:
        with self.lock:
            self.conn.send(msg)


def _watchdog(parent_pid: int, sender: _Sender, ready: threading.Event, interval: float) -> None:
    """Exit when the parent is gone (a second line behind PR_SET_PDEATHSIG); once ready, send a
    heartbeat every `interval` s. It is a thread of its own so that a worker busy in a kernel
    still beats, and one that is stopped (SIGSTOP stops every thread) falls silent."""
    beats, next_beat = 0, 0.0
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        now = time.monotonic()
        if ready.is_set() and now >= next_beat:
            try:
                sender.send(Heartbeat(beats))
            except OSError:
                os._exit(1)  # the supervisor closed its end
            beats, next_beat = beats + 1, now + interval
        time.sleep(WATCH_INTERVAL)


def _recv(sock: socket.socket) -> tuple[RunTask | Forget | Stop, list[int]]:
    """One message as `WorkerProcess.send` frames it (`Connection`'s framing) and the
    descriptors that came with its first bytes."""
    head, ancillary, flags, _ = sock.recvmsg(4, socket.CMSG_SPACE(MAX_FDS * 4))
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(data[: len(data) - len(data) % got.itemsize])
            fds.extend(got)
    if not head:
        raise EOFError
    head += _recv_exact(sock, 4 - len(head))
    (n,) = struct.unpack("!i", head)
    msg: RunTask | Forget | Stop = pickle.loads(_recv_exact(sock, n))
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        fds = []  # descriptors were lost (this process has none left): the task fails
    return msg, fds


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = sock.recv(left)
        if not part:
            raise EOFError
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def main(
    conn: Connection,
    parent_pid: int,
    cpus: tuple[int, ...],
    threads: int,
    warm_zentorch: bool,
    heartbeat_interval: float,
) -> None:
    """Entry point of a spawned worker. Messages (`_messages`, never tensor bytes):

    in:  `RunTask` with one descriptor attached per `spec.buffers` entry marked sent, in order,
         then the socket `spec.reply` is written to, where set; `Forget` (unmap, no answer);
         `Stop`. `spec.forget`: buffers to unmap.
    out: `Ready`; `Done` (after `spec.reply` is written); `Failed`; `Heartbeat` every
         `heartbeat_interval` s from the watchdog thread.

    After `Failed` the worker keeps none of the task's buffers mapped; the supervisor sends
    their descriptors again when it next needs them.
    """
    _die_with_parent(parent_pid)
    sender, ready = _Sender(conn), threading.Event()
    threading.Thread(
        target=_watchdog,
        args=(parent_pid, sender, ready, heartbeat_interval),
        name="zen-mla-watchdog",
        daemon=True,
    ).start()
    _setup(cpus, threads)
    import torch

    torch.set_num_threads(threads)
    running = threads  # the threads the kernels run on now (a small task's: one)
    if warm_zentorch:
        from zen_mla.attention.kernels.zentorch import zentorch_op

        zentorch_op()  # import zentorch now, not on the first request
    sender.send(Ready(os.getpid()))
    ready.set()
    # a socket object over the pipe's descriptor, to receive descriptors (recvmsg)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, conn.fileno())
    mapped = _Mapped()
    while True:
        try:
            msg, fds = _recv(sock)
        except (EOFError, OSError):
            return  # the supervisor is gone
        if isinstance(msg, Forget):
            for fd in fds:
                os.close(fd)
            mapped.forget(msg.buffers)
            continue
        if not isinstance(msg, RunTask):
            return  # Stop
        spec = msg.spec
        mapped.forget(spec.forget)
        try:
            fresh = [b for b in spec.buffers if b.sent]
            wanted = len(fresh) + (spec.reply is not None)
            if len(fds) != wanted:
                raise OSError(f"{wanted} descriptors sent, {len(fds)} arrived")
            for b in fresh:
                mapped.map(b.id, fds.pop(0), b.nbytes, b.populate)  # it owns the descriptor
            if (spec.threads or threads) != running:
                running = spec.threads or threads
                torch.set_num_threads(running)
            _run(spec, mapped)
        except Exception as exc:  # reported, never fatal: the next task gets a clean slate
            for fd in fds:
                os.close(fd)
            mapped.forget(b.id for b in spec.buffers)
            sender.send(Failed(msg.task_id, *parts_of(exc)))
        else:
            if spec.reply is not None:
                _reply(fds.pop(0), spec.reply)
            sender.send(Done(msg.task_id))


def _reply(fd: int, frame: bytes) -> None:
    """`frame` written to the caller's socket `fd` (closed here) at once, whole or not at all:
    a socket that takes less (a caller that does not read its replies) is shut down, as the
    service ends such a connection; one whose caller is gone is left."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket: nothing to answer on
        os.close(fd)
        return
    with sock:
        try:
            sent = sock.send(frame, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return  # the caller hung up
        if sent < len(frame):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _Mapped:
    """The buffers this worker has mapped, by id, and the tensors recent tasks named in them.

    Mappings stay across tasks (the supervisor reuses buffers), so a task maps nothing new and
    touches no page table; the supervisor says which to forget when it frees a buffer. An
    orchestrator's calls name the same tensors call after call (its layers' regions), so their
    views are kept too, by `TensorRef` (measured on Zen 5: five views cost a 1-token task
    27 us, a third of its kernel), and all dropped whenever a mapping changes."""

    def __init__(self) -> None:
        self._maps: dict[int, Any] = {}  # buffer id -> a uint8 tensor over its mapping
        self._views: dict[TensorRef, Any] = {}

    def map(self, buf_id: int, fd: int, nbytes: int, populate: bool) -> None:
        """The buffer behind `fd` (closed here; the mapping keeps it), mapped as `buf_id`."""
        import torch

        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        try:
            m = mmap.mmap(fd, max(nbytes, 1), flags=flags)
        except PermissionError:  # a client's memfd sealed against writing since it was checked
            raise InvalidInputError(
                "region",
                "a memfd a worker may map to write the outputs",
                "one sealed against writing (F_SEAL_FUTURE_WRITE) since the service checked it",
            ) from None
        finally:
            os.close(fd)
        self._views.clear()
        self._maps[buf_id] = torch.frombuffer(m, dtype=torch.uint8)

    def forget(self, buf_ids: Iterable[int]) -> None:
        for buf_id in buf_ids:
            if self._maps.pop(buf_id, None) is not None:
                self._views.clear()

    def tensor(self, ref: TensorRef) -> Any:
        """The tensor `ref` names in a mapped buffer."""
        t = self._views.get(ref)
        if t is None:
            from ._shm import view

            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            t = self._views[ref] = view(self._maps[ref.buffer], ref)
        return t


def _run(spec: TaskSpec, mapped: _Mapped) -> None:
    from zen_mla.attention.batch import RaggedBatch
    from zen_mla.attention.driver import attend
    from zen_mla.attention.kernels import KERNELS

    if spec.latent is not None:
        _run_latent(spec, spec.latent, mapped)
        return
    assert spec.k is not None and spec.v is not None
    q, k, v, out = (mapped.tensor(r) for r in (spec.q, spec.k, spec.v, spec.out))
    lse = mapped.tensor(spec.lse) if spec.lse is not None else None
    kernel = KERNELS[spec.kernel]
    for piece in spec.pieces:
        h = slice(piece.h0, piece.h1)
        qs, ks = slice(piece.q_lo, piece.q_hi), slice(piece.kv_lo, piece.kv_hi)
        batch = RaggedBatch(
            q[qs, h], k[ks, h], v[ks, h], piece.q_cu, piece.kv_cu, spec.causal, spec.scale
        )
        attend(
            batch,
            kernel,
            return_lse=lse is not None,
            out=out[qs, h],
            lse=lse[h, qs] if lse is not None else None,
        )


def _run_latent(spec: TaskSpec, latent: Latent, mapped: _Mapped) -> None:
    """The pieces over the latent cache: each piece's heads take their rows of `w_kv_b`."""
    import torch

    from zen_mla.attention.latent import Form, Precision, latent_attention

    q, out = mapped.tensor(spec.q), mapped.tensor(spec.out)
    kv_c, k_pe, w = (mapped.tensor(r) for r in (latent.kv_c, latent.k_pe, latent.w_kv_b))
    lse = mapped.tensor(spec.lse) if spec.lse is not None else None
    rows = w.shape[0] // q.shape[1]  # a head's Dn + Dv rows
    for piece in spec.pieces:
        h = slice(piece.h0, piece.h1)
        qs, ks = slice(piece.q_lo, piece.q_hi), slice(piece.kv_lo, piece.kv_hi)
        args = (
            q[qs, h],
            kv_c[ks],
            k_pe[ks],
            w[piece.h0 * rows : piece.h1 * rows],
            torch.tensor(piece.q_cu),
            torch.tensor(piece.kv_cu),
        )
        # one of FORMS and PRECISIONS: checked where the request was read
        form, precision = cast(Form, latent.form), cast(Precision, latent.precision)
        if lse is None:  # its LSE not asked: nothing spent on it
            out[qs, h] = latent_attention(
                *args, causal=spec.causal, scale=spec.scale, form=form, precision=precision
            )
            continue
        got, got_lse = latent_attention(
            *args, causal=spec.causal, return_lse=True, scale=spec.scale, form=form,
            precision=precision,
        )  # fmt: skip
        out[qs, h] = got
        lse[h, qs] = got_lse
