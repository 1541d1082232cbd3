"""A task's way to a worker process and back: sent with the descriptors the worker lacks, its
answer read and told apart from heartbeats and from answers out of turn, and the outcome handed
to the task's job; a worker heard from, or silent for too long mid-task. `Dispatcher` (the
worker's owner) runs tasks through these; so does a borrower (`_direct.DirectRun`), through the
dispatcher it borrowed from."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Any

from ..errors import KernelError, ServiceUnavailableError, ZenMLAError, from_parts
from ._config import PoolConfig
from ._job import Reply, Task
from ._messages import Beat, BufferUse, Done, Failed, RunTask, ToSupervisor
from ._process import SendFailedError, WorkerGoneError, WorkerProcess
from ._shm import WorkerMappings
from .topology import WorkerSlot

__all__ = ["Outcome", "ProtocolError", "TaskTraffic"]

log = logging.getLogger("zen_mla.pool")


class ProtocolError(Exception):
    """The worker said something out of turn (an answer to a task it was not running): it is
    replaced, and the task at hand fails."""


#: how a task ended: answered, failed in the worker, not sent, lost with the process (why), or
#: answered out of turn
Outcome = Done | Failed | SendFailedError | str | ProtocolError


class TaskTraffic:
    """Tasks to one worker and their answers back. Only the party that holds the worker (see
    `Dispatcher`) calls these with its process."""

    slot: WorkerSlot
    _config: PoolConfig
    _mappings: WorkerMappings
    _lost: Callable[[Task, Any], None]  # (the task, the Dispatcher it was lost on)
    lock: threading.Lock
    state: str
    proc: WorkerProcess | None
    heard_at: float

    def _set(self, state: str, proc: WorkerProcess | None = None) -> None:
        raise NotImplementedError

    def _check_silence(self) -> None:
        """Mark a busy worker that has been silent for `ping_timeout` s stuck. Not killed: a
        slow task is the caller's to abandon (its deadline); a stopped one may resume. Reported
        as not alive meanwhile."""
        silent = time.monotonic() - self.heard_at
        if silent <= self._config.ping_timeout:
            return
        with self.lock:  # busy still: a borrower may have given it back idle meanwhile
            if self.state != "busy":
                return
            self.state = "stuck"
            pid = self.proc.pid if self.proc else None
        log.warning(
            "worker %d (pid %s) silent for %.1f s mid-task: stuck", self.slot.id, pid, silent
        )

    def heard(self) -> None:
        """A message came from the worker: it is alive (and no longer stuck)."""
        self.heard_at = time.monotonic()
        if self.state == "stuck":
            log.warning("worker %d is answering again", self.slot.id)
            self._set("busy")

    def _run_on(self, proc: WorkerProcess, task: Task) -> Outcome:
        """The worker's answer to `task`, SendFailedError if it could not be sent, or why the
        process is lost (a string, or a ProtocolError: it answered out of turn)."""
        sent = self.send(proc, task)
        if sent is not None:
            return sent
        while True:
            ready = wait([proc.conn, proc.sentinel], self._config.ping_interval)
            if proc.conn in ready:
                try:
                    msg: ToSupervisor = proc.recv()
                except (EOFError, OSError):
                    return "died"
                answer = self.answer(task, msg)
                if answer is not None:
                    return answer
            elif proc.sentinel in ready:
                return f"died (exit code {proc.exitcode})"
            else:
                self._check_silence()

    def send(
        self, proc: WorkerProcess, task: Task, reply: Reply | None = None
    ) -> SendFailedError | str | None:
        """Send `task` (and the `reply` its worker is to write) to `proc`: None once sent,
        SendFailedError if nothing went out, or why the process is lost."""
        if task.job.started_at is None:
            task.job.started_at = time.perf_counter()
        forget, fresh = self._mappings.plan(self.slot.id, task.buffers)
        spec = replace(
            task.spec,
            buffers=tuple(BufferUse(b.id, b.nbytes, b in fresh, b.populate) for b in task.buffers),
            forget=forget,
            reply=None if reply is None else reply.frame,
        )
        try:
            proc.send(RunTask(task.id, spec), [b.fd for b in fresh] + ([reply.fd] if reply else []))
        except SendFailedError as exc:
            log.warning("worker %d: could not send a task: %s", self.slot.id, exc)
            return exc
        except WorkerGoneError as exc:
            return f"lost its pipe ({exc})"
        self._mappings.sent(self.slot.id, forget, [b.id for b in fresh])
        return None

    def answer(self, task: Task, msg: ToSupervisor) -> Done | Failed | ProtocolError | None:
        """A message from the worker busy with `task`: its answer, None (a heartbeat), or a
        ProtocolError (anything else: an answer to another task never settles this one)."""
        self.heard()
        if isinstance(msg, Beat):
            return None
        if isinstance(msg, Done | Failed) and msg.task_id == task.id:
            if isinstance(msg, Failed):  # the worker unmapped the task's buffers
                self._mappings.unmapped(self.slot.id, [b.id for b in task.buffers])
            return msg
        return ProtocolError(f"sent {msg!r} while running task {task.id} (a protocol error)")

    def settle(self, task: Task, outcome: Outcome) -> None:
        """Hand `outcome` of `task` to its job: done, failed, or lost with the process."""
        if isinstance(outcome, ProtocolError):  # out of step: the task's result is not known
            task.job._fail(KernelError(f"worker {self.slot.id} {outcome}"))
        elif isinstance(outcome, str):  # the process died under the task, or the pipe broke
            self._lost(task, self)
        elif isinstance(outcome, SendFailedError):
            task.job._fail(
                ServiceUnavailableError(
                    f"could not hand work to worker {self.slot.id}: {outcome}", retry_after=1.0
                )
            )
        elif isinstance(outcome, Done):
            task.job._piece_done()
        else:
            task.job._fail(self._raised(outcome))

    def _raised(self, failed: Failed) -> ZenMLAError:
        """The worker's exception as the class it was raised as, where it is one of ours;
        anything else is a KernelError saying what it was."""
        raised = from_parts(failed.error_type, failed.message, failed.fields)
        if raised is not None:
            return raised
        return KernelError(f"worker {self.slot.id}: {failed.error_type}: {failed.message}")
