"""One worker as the pool sees it: its process, its queue of tasks and the thread that feeds it.

The dispatcher thread sends the worker one task at a time and waits for its answer, its death or
its silence (workers send a heartbeat from a thread of their own); between tasks it reads the
heartbeats. It replaces a worker that dies, retrying with backoff until a replacement starts, and
hands the work that was lost with it back to the pool through a callback.

An idle worker with nothing queued may instead be lent (`lend()`) to an event loop that runs one
task on it directly (`_direct.DirectRun`): the loop sends the task and reads the answer itself,
and the dispatcher thread keeps off the pipe until it is given back (`give_back()`), replacing
the worker then if it died meanwhile.

A task's way to the worker and back is the same for both: sent with the descriptors the worker
lacks (`send`), its answer read and told apart from heartbeats and from answers out of turn
(`answer`), and how it ended (`Outcome`) handed to the task's job (`settle`).

One owner at a time: the worker's process and its pipe are used by whoever holds `owner` (the
dispatcher thread, for a task or to read an idle worker's heartbeats; or one borrower), taken
and given back in one step under `lock`. A loan is refused while the thread holds the worker,
and the thread waits out a loan before it takes the worker, so no two parties ever send on or
read one pipe. Every answer names its task: one naming another task is a protocol error, which
fails the task at hand and replaces the worker, and never settles a job.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from multiprocessing.connection import wait
from typing import Any

from ..errors import KernelError, ServiceUnavailableError, ZenMLAError, from_parts
from ._config import PoolConfig
from ._job import LostOnLoan, PoolJob, Reply, StopDispatching, Task, TaskQueue
from ._messages import BufferUse, Done, Failed, Forget, Heartbeat, RunTask, ToSupervisor
from ._process import SendFailedError, WorkerGoneError, WorkerProcess, start_until_ready
from ._shm import WorkerMappings
from .topology import WorkerSlot

__all__ = [
    "Dispatcher",
    "Lost",
    "NotSent",
    "OutOfTurn",
    "Outcome",
    "Owner",
    "WorkerState",
    "worker_lost",
]

log = logging.getLogger("zen_mla.pool")
#: the longest an idle worker keeps a freed buffer mapped, in seconds (a region whose client
#: left, say): the dispatcher thread looks in on an idle worker this often
FORGET_WITHIN = 0.5


class WorkerState(StrEnum):
    """Where a worker is, as `WorkerPool.workers()` and /health name it."""

    STARTING = "starting"  # being spawned or replaced
    IDLE = "idle"
    BUSY = "busy"
    STUCK = "stuck"  # silent for `heartbeat_timeout` mid-task
    DEAD = "dead"  # exited, not noticed yet (reported only)
    STOPPED = "stopped"  # the pool closed


class Owner(StrEnum):
    """Who holds a worker's pipe: its dispatcher thread, or a borrower (`Dispatcher.lend`)."""

    THREAD = "thread"
    LOAN = "loan"


THREAD, LOAN = Owner.THREAD, Owner.LOAN


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


class Dispatcher:
    """One CCX's worker. Once `start()`ed, its dispatcher thread is the only one to replace
    `proc`; `lock` guards `owner`, `proc`, `state`, `current`, `lost_why` and `restarts` against
    the other threads (`info()`, `cancel()`, `lend()`, `give_back()`, `stop_dispatching()`,
    `stop()`). The queue locks itself. Only the holder of `owner` sends on or reads the pipe
    and sets `heard_at` (the dispatcher thread reads it while the worker is lent, to mark a
    silent one stuck).

    `lost(task, self)` is called with a task the worker died under (or could not be given
    because the pool closed); `stranded(self)` when the worker is being replaced, to move the
    tasks still queued on it (`queue.take_all()`) elsewhere.

    While lent (`owner == LOAN`), the borrower alone reads and writes the pipe; `lost_why` says
    the worker died under it, and a `LostOnLoan` on the queue wakes the dispatcher thread to
    replace it.
    """

    def __init__(
        self,
        slot: WorkerSlot,
        config: PoolConfig,
        spawn: Callable[[WorkerSlot], WorkerProcess],
        mappings: WorkerMappings,
        closed: threading.Event,
        lost: Callable[[Task, Dispatcher], None],
        stranded: Callable[[Dispatcher], None],
    ) -> None:
        self.slot = slot
        self._config = config
        self._spawn = spawn
        self._mappings = mappings
        self._closed = closed  # the pool is closing: no more replacements
        self._lost = lost
        self._stranded = stranded
        self.proc: WorkerProcess | None = None
        self.state = WorkerState.STARTING
        self.queue = TaskQueue()
        self.current: Task | None = None
        self.restarts = 0
        self.heard_at = 0.0  # time.monotonic() of the process's last message
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.owner: Owner | None = None  # None: nobody uses the process now
        self.lost_why: str | None = None
        self._given_back = threading.Condition(self.lock)

    @property
    def ready(self) -> bool:
        """Can take work now (read without the lock: a hint for placing work)."""
        return self.state in (WorkerState.IDLE, WorkerState.BUSY)

    def _set(self, state: WorkerState, proc: WorkerProcess | None = None) -> None:
        with self.lock:
            self.state = state
            if proc is not None:
                self.proc = proc

    # -- life cycle (called by the pool) -----------------------------------------------------

    def spawn(self) -> None:
        """Start this worker's first process (not waiting for it to be ready)."""
        self._set(WorkerState.STARTING, self._spawn(self.slot))

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        self.proc.wait_ready(deadline, self._closed)
        self.heard_at = time.monotonic()
        self._set(WorkerState.IDLE)

    def start(self) -> None:
        self.thread = threading.Thread(
            target=self._loop, daemon=True, name=f"zen-mla-worker-{self.slot.id}"
        )
        self.thread.start()

    def stop_dispatching(self) -> None:
        """Let the thread finish once the queue is drained; kill a process busy with a task."""
        self.queue.put(StopDispatching())
        with self.lock:
            if self.current is not None and self.proc is not None:
                self.proc.kill()

    def stop(self) -> None:
        """Wait (5 s at most) for the thread, then stop the process."""
        if self.thread is not None:
            self.thread.join(timeout=5)
        with self.lock:
            proc, self.proc, self.state = self.proc, None, WorkerState.STOPPED
        if proc is not None:
            proc.stop()

    def cancel(self, job: PoolJob) -> None:
        """`job` was cancelled: its tasks queued here are dropped, and the worker is stopped
        if it was given one of them (`current`: a job withdrawn before any was given never
        is)."""
        self.queue.drop(job)
        with self.lock:
            task, proc = self.current, self.proc
            if task is not None and task.job is job and proc is not None:
                proc.kill()  # seen dying, then replaced; no one takes it for ready meanwhile
                self.state = WorkerState.STARTING

    def lend(self, task: Task) -> WorkerProcess | None:
        """The process, busy with `task` from now on (its job is started), for a borrower that
        sends the task and reads the answer itself (`send()`, `answer()`); None unless nobody
        holds the worker and it is idle with nothing queued. The borrower must `give_back()`
        (and `task.job._untake()` should it send nothing)."""
        with self.lock:
            free = self.owner is None and self.state == WorkerState.IDLE and self.lost_why is None
            if not free or self.proc is None or self._closed.is_set() or self.queue.qsize():
                return None
            if not task.job._take():
                return None  # ended already: queued, it is skipped
            self.owner, self.current, self.state = LOAN, task, WorkerState.BUSY
            return self.proc

    def give_back(self, died: str | None = None) -> None:
        """End a loan; `died`: why the process is lost (the dispatcher thread replaces it)."""
        with self.lock:
            if self.owner != LOAN:
                raise RuntimeError(f"worker {self.slot.id}: given back, but held by {self.owner}")
            self.owner, self.current = None, None
            if died is None and self.state == WorkerState.STARTING:
                died = "was stopped (its job was cancelled)"  # answered as it was killed
            if died is None:
                self.state = WorkerState.IDLE
            else:
                self.lost_why = died
            self._given_back.notify_all()
        if died is not None:
            self.queue.put(LostOnLoan())  # wakes the dispatcher thread to replace the worker

    def info(self) -> dict[str, Any]:
        """As `WorkerPool.workers()` describes."""
        with self.lock:
            proc, state, restarts = self.proc, self.state, self.restarts
            running = proc is not None and proc.is_alive()
        if state in (WorkerState.IDLE, WorkerState.BUSY, WorkerState.STUCK) and not running:
            state = WorkerState.DEAD
        return {
            "id": self.slot.id,
            "cpus": list(self.slot.cpus),
            "threads": self.slot.threads,
            "alive": state in (WorkerState.IDLE, WorkerState.BUSY),
            "state": state,
            "pid": proc.pid if proc is not None else None,
            "restarts": restarts,
        }

    # -- a task's way to the worker and back (whoever holds `owner`: the thread, a borrower) --

    def _check_silence(self) -> None:
        """Mark a busy worker that has been silent for `heartbeat_timeout` s stuck. Not killed: a
        slow task is the caller's to abandon (its deadline); a stopped one may resume. Reported
        as not alive meanwhile."""
        silent = time.monotonic() - self.heard_at
        if silent <= self._config.heartbeat_timeout:
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
        if self.state != WorkerState.STUCK:  # a hint read without the lock: most messages stop here
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
            ready = wait([proc.conn, proc.sentinel], self._config.heartbeat_interval)
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
        if isinstance(msg, Heartbeat):
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

    # -- the dispatcher thread ---------------------------------------------------------------

    def _replace(self, why: str) -> None:
        """Kill the process and start another, retrying with backoff (0.1 s doubling to 5 s)
        until one starts or the pool closes; `stranded` moves the work queued here meanwhile."""
        with self.lock:
            old, self.proc, self.state = self.proc, None, WorkerState.STARTING
            self.restarts += 1
        log.warning(
            "worker %d (pid %s) %s; replacing it", self.slot.id, old.pid if old else None, why
        )
        if old is not None:
            old.kill()
            old.stop()
        self._mappings.lost(self.slot.id)
        self._stranded(self)
        self._respawn()

    def _respawn(self) -> None:
        """Start a process for this worker, which has none (retrying until one is ready or the
        pool closes)."""
        proc = start_until_ready(
            lambda: self._spawn(self.slot),
            self._config.start_timeout,
            self._closed,
            f"worker {self.slot.id}",
        )
        if proc is not None:
            self.heard_at = time.monotonic()
            self._set(WorkerState.IDLE, proc)
            log.warning("worker %d replaced (pid %s)", self.slot.id, proc.pid)

    def _loop(self) -> None:
        while True:
            try:
                if not self._dispatch_one():
                    return
            except Exception as exc:  # a bug of ours: fail the task at hand, keep dispatching
                log.exception("worker %d: dispatcher error", self.slot.id)
                with self.lock:
                    task, self.current = self.current, None
                if task is not None:
                    task.job._fail(
                        KernelError(f"worker {self.slot.id}: {type(exc).__name__}: {exc}")
                    )
                self._closed.wait(0.1)  # no hot loop should the error repeat

    def _dispatch_one(self) -> bool:
        """Run one task from the queue, or check on the idle worker; False: stop dispatching."""
        try:
            item = self.queue.get(timeout=min(self._config.heartbeat_interval, FORGET_WITHIN))
        except queue.Empty:
            if not self._closed.is_set():
                self._check_idle()
            return True
        if isinstance(item, StopDispatching):
            return False
        if isinstance(item, Task) and item.job.done():
            return True  # cancelled or failed while queued
        if not self._hold():  # the pool closed while the worker was lent
            if isinstance(item, Task):
                self._lost(item, self)
            return True
        if isinstance(item, LostOnLoan):
            self._while_held(self._replace_if_lost)
        else:
            self._while_held(self._run_held, item)
        return True

    def _while_held(self, work: Callable[..., object], *args: Any) -> None:
        """`work(*args)` while this thread holds the worker, then the hold ends. Should it raise
        (a bug of ours), the pipe may be out of step: the worker is replaced first."""
        try:
            work(*args)
        except BaseException as exc:
            if self.owner == THREAD and not self._closed.is_set():  # (a borrower's, else)
                with contextlib.suppress(Exception):
                    self._replace(f"was in use when its dispatcher failed ({exc!r})")
            raise
        finally:
            self._release()

    def _run_held(self, task: Task) -> None:
        """`task` on the worker this thread holds (replaced first, should it have died while
        lent)."""
        self._replace_if_lost()
        if self.proc is None and not self._closed.is_set():
            self._respawn()  # a replacement an error of ours interrupted
        if self.proc is None:  # the pool closed before a replacement started
            self._lost(task, self)
            return
        with self.lock:
            # Given under the one lock `cancel()` takes: a cancel either comes before (the job
            # is done: skipped) or finds the task current (the worker stopped); and under the
            # job's, so that a job withdrawn before this is skipped, and one withdrawn after is
            # not (it has started and runs on).
            if not task.job._take():
                return
            self.current, self.state = task, WorkerState.BUSY  # current left set if _run_on raises
        outcome = self._run_on(self.proc, task)
        lost = worker_lost(outcome)
        with self.lock:
            self.current = None
            if lost is None:
                # free for the next call before this one's caller hears of it
                self.owner = None
                if self.state == WorkerState.BUSY:
                    self.state = WorkerState.IDLE
        self.settle(task, outcome)  # a lost task first, so that it need not wait for the respawn
        if lost is not None and not self._closed.is_set():
            self._replace(lost)

    def _hold(self) -> bool:
        """Take the worker for this thread, waiting out a loan (marking the worker stuck should
        it fall silent meanwhile); False if the pool closed while it was lent."""
        while True:
            with self.lock:
                if self.owner is None:
                    self.owner = THREAD
                    return True
                if self._closed.is_set():
                    return False
                self._given_back.wait(self._config.heartbeat_interval)
                if self.owner is None:
                    self.owner = THREAD
                    return True
            self._check_silence()

    def _release(self) -> None:
        """This thread's hold on the worker ends (where it still has one)."""
        with self.lock:
            if self.owner == THREAD:
                self.owner = None
                if self.state == WorkerState.BUSY:
                    self.state = WorkerState.IDLE

    def _replace_if_lost(self) -> bool:
        """Replace a process that died while lent; True if it did."""
        with self.lock:
            why, self.lost_why = self.lost_why, None
        if why is None:
            return False
        if not self._closed.is_set():
            self._replace(why)
        return True

    def _check_idle(self) -> None:
        """Read the heartbeats of an idle worker and have it unmap the buffers freed here since
        its last task; replace it if it died or fell silent (it holds no work, so nothing is
        lost). Left alone while lent: the borrower reads the pipe."""
        with self.lock:
            if self.owner is not None:
                held = False
            else:
                self.owner, held = THREAD, True
        if not held:
            self._check_silence()
            return
        self._while_held(self._look_in)

    def _look_in(self) -> None:
        if self._replace_if_lost():
            return
        proc = self.proc
        if proc is None:
            self._respawn()  # a replacement an error of ours interrupted
            return
        try:
            while proc.conn.poll(0):
                msg: ToSupervisor = proc.recv()
                self.heard_at = time.monotonic()
                if not isinstance(msg, Heartbeat):
                    self._replace(f"sent {msg!r} while idle (a protocol error)")
                    return
        except (EOFError, OSError):
            self._replace("closed its pipe")
            return
        if not proc.is_alive():
            self._replace(f"exited (code {proc.exitcode})")
        elif time.monotonic() - self.heard_at > self._config.heartbeat_timeout:
            self._replace(f"was silent for {self._config.heartbeat_timeout} s while idle")
        else:
            self._forget_freed(proc)

    def _forget_freed(self, proc: WorkerProcess) -> None:
        """Tell the idle worker to unmap the buffers freed here since its last task, so that a
        region whose client left is not kept mapped until the worker's next task."""
        forget, _ = self._mappings.plan(self.slot.id, ())
        if not forget:
            return
        try:
            proc.send(Forget(forget))
        except SendFailedError:
            return  # told with its next task, or on the next look
        except WorkerGoneError as exc:
            self._replace(f"lost its pipe ({exc})")
            return
        self._mappings.sent(self.slot.id, forget, ())
