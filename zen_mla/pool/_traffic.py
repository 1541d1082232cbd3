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
from dataclasses import dataclass, replace
from enum import StrEnum
from multiprocessing.connection import wait
from typing import Any

from ..errors import KernelError, ServiceUnavailableError, ZenMLAError, from_parts
from ._config import PoolConfig
from ._job import Reply, Task
from ._messages import Beat, BufferUse, Done, Failed, RunTask, ToSupervisor
from ._process import SendFailedError, WorkerGoneError, WorkerProcess
from ._shm import WorkerMappings
from .topology import WorkerSlot

__all__ = [
    "Lost",
    "NotSent",
    "OutOfTurn",
    "Outcome",
    "Owner",
    "TaskTraffic",
    "WorkerState",
    "worker_lost",
]

log = logging.getLogger("zen_mla.pool")


class WorkerState(StrEnum):
    """Where a worker is, as `WorkerPool.workers()` and /health name it."""

    STARTING = "starting"  # being spawned or replaced
    IDLE = "idle"
    BUSY = "busy"
    STUCK = "stuck"  # silent for `ping_timeout` mid-task
    DEAD = "dead"  # exited, not noticed yet (reported only)
    STOPPED = "stopped"  # the pool closed


class Owner(StrEnum):
    """Who holds a worker's pipe: its dispatcher thread, or a borrower (`Dispatcher.lend`)."""

    THREAD = "thread"
    LOAN = "loan"


@dataclass(frozen=True)
class NotSent:
    """Nothing of the task went out (no memory, no buffer space...): it fails, and the worker,
    as it was, is kept."""

    why: str


@dataclass(frozen=True)
class Lost:
    """The process died under the task, or its pipe broke: the task goes back to the pool (to
    be redone elsewhere) and the worker is replaced."""

    why: str


@dataclass(frozen=True)
class OutOfTurn:
    """The worker said something out of turn (an answer to a task it was not running, say): a
    protocol error. The task fails (its result is not known) and the worker is replaced."""

    why: str


#: how a task ended: answered (`Done`), failed in the worker (`Failed`), not sent, lost with
#: the process, or answered out of turn
Outcome = Done | Failed | NotSent | Lost | OutOfTurn


def worker_lost(outcome: Outcome) -> str | None:
    """Why the worker is to be replaced after `outcome`; None: it is kept."""
    return outcome.why if isinstance(outcome, Lost | OutOfTurn) else None


class TaskTraffic:
    """Tasks to one worker and their answers back. Only the party that holds the worker (see
    `Dispatcher`) calls these with its process."""

    slot: WorkerSlot
    _config: PoolConfig
    _mappings: WorkerMappings
    _lost: Callable[[Task, Any], None]  # (the task, the Dispatcher it was lost on)
    lock: threading.Lock
    state: WorkerState
    proc: WorkerProcess | None
    heard_at: float

    def _check_silence(self) -> None:
        """Mark a busy worker that has been silent for `ping_timeout` s stuck. Not killed: a
        slow task is the caller's to abandon (its deadline); a stopped one may resume. Reported
        as not alive meanwhile."""
        silent = time.monotonic() - self.heard_at
        if silent <= self._config.ping_timeout:
            return
        with self.lock:  # busy still: a borrower may have given it back idle meanwhile
            if self.state != WorkerState.BUSY:
                return
            self.state = WorkerState.STUCK
            pid = self.proc.pid if self.proc else None
        log.warning(
            "worker %d (pid %s) silent for %.1f s mid-task: stuck", self.slot.id, pid, silent
        )

    def heard(self) -> None:
        """A message came from the worker: it is alive (and no longer stuck)."""
        self.heard_at = time.monotonic()
        if (
            self.state != WorkerState.STUCK
        ):  # (a hint read without the lock: most messages pass here)
            return
        with self.lock:  # stuck still: a cancel may have stopped it meanwhile
            again = self.state == WorkerState.STUCK
            if again:
                self.state = WorkerState.BUSY
        if again:
            log.warning("worker %d is answering again", self.slot.id)

    def _run_on(self, proc: WorkerProcess, task: Task) -> Outcome:
        """How `task` ended on `proc`: its answer, not sent, the process lost, or an answer out
        of turn."""
        sent = self.send(proc, task)
        if sent is not None:
            return sent
        while True:
            ready = wait([proc.conn, proc.sentinel], self._config.ping_interval)
            if proc.conn in ready:
                try:
                    msg: ToSupervisor = proc.recv()
                except (EOFError, OSError):
                    return Lost("died")
                answer = self.answer(task, msg)
                if answer is not None:
                    return answer
            elif proc.sentinel in ready:
                return Lost(f"died (exit code {proc.exitcode})")
            else:
                self._check_silence()

    def send(
        self, proc: WorkerProcess, task: Task, reply: Reply | None = None
    ) -> NotSent | Lost | None:
        """Send `task` (and the `reply` its worker is to write) to `proc`: None once sent, else
        how the task ended (nothing went out, or the process is lost). The job was started
        when the worker was given the task (`PoolJob._take`)."""
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
            return NotSent(str(exc))
        except WorkerGoneError as exc:
            return Lost(f"lost its pipe ({exc})")
        self._mappings.sent(self.slot.id, forget, [b.id for b in fresh])
        return None

    def answer(self, task: Task, msg: ToSupervisor) -> Done | Failed | OutOfTurn | None:
        """A message from the worker busy with `task`: its answer, None (a heartbeat), or
        OutOfTurn (anything else: an answer to another task never settles this one)."""
        self.heard()
        if isinstance(msg, Beat):
            return None
        if isinstance(msg, Done | Failed) and msg.task_id == task.id:
            if isinstance(msg, Failed):  # the worker unmapped the task's buffers
                self._mappings.unmapped(self.slot.id, [b.id for b in task.buffers])
            return msg
        return OutOfTurn(f"sent {msg!r} while running task {task.id} (a protocol error)")

    def settle(self, task: Task, outcome: Outcome) -> None:
        """Hand `outcome` of `task` to its job: done, failed, or lost with the process."""
        if isinstance(outcome, Done):
            task.job._piece_done()
        elif isinstance(outcome, Failed):
            task.job._fail(self._raised(outcome))
        elif isinstance(outcome, NotSent):
            task.job._fail(
                ServiceUnavailableError(
                    f"could not hand work to worker {self.slot.id}: {outcome.why}",
                    retry_after=1.0,
                )
            )
        elif isinstance(outcome, Lost):
            self._lost(task, self)
        else:  # out of step: the task's result is not known
            task.job._fail(KernelError(f"worker {self.slot.id} {outcome.why}"))

    def _raised(self, failed: Failed) -> ZenMLAError:
        """The worker's exception as the class it was raised as, where it is one of ours;
        anything else is a KernelError saying what it was."""
        raised = from_parts(failed.error_type, failed.message, failed.fields)
        if raised is not None:
            return raised
        return KernelError(f"worker {self.slot.id}: {failed.error_type}: {failed.message}")
