"""A submitted batch as its caller holds it (`PoolJob`, then `PoolResult`), one worker's share
of it (`Task`) and the queue of shares waiting for one worker (`TaskQueue`), which also carries
the dispatcher thread's two other messages (`LostOnLoan`, `StopDispatching`)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import torch

from ._messages import TaskSpec
from ._shm import BufferCache, SharedBuffer

__all__ = [
    "LostOnLoan",
    "OutputPlaces",
    "PoolJob",
    "PoolResult",
    "Queued",
    "Reply",
    "StopDispatching",
    "Task",
    "TaskQueue",
]

T = TypeVar("T")


class PoolResult:
    """out `[Tq, H, Dv]` and lse `[H, Tq]` (or None) as views of shared memory.

    `release()` hands the memory back for reuse; the tensors must not be used after it. Without
    it the memory is simply freed once the tensors are. Outputs written where the caller said
    (`OutputPlaces`) stay the caller's: `cache` is None and `release()` does nothing. `replied`: the
    worker wrote the job's `Reply`.
    """

    def __init__(
        self,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        kernel: str,
        buffer: SharedBuffer,
        cache: BufferCache | None,
        replied: bool = False,
    ) -> None:
        self.out, self.lse, self.kernel, self.replied = out, lse, kernel, replied
        self._buffer: SharedBuffer | None = buffer
        self._cache = cache

    def release(self) -> None:
        if self._buffer is not None and self._cache is not None:
            self._cache.put(self._buffer)
        self._buffer = None


#: where a job's results are to be written: a buffer, and out `[Tq, H, Dv]` and lse `[H, Tq]`
#: fp32 (or None) as views of it
OutputPlaces = tuple[SharedBuffer, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class Reply:
    """A frame for the worker to write to the caller's socket `fd` once the job's work is done,
    before it tells the pool: the caller is answered with no hop back through this process. Only
    a job run from the loop's thread on one worker is answered so (`submit_batch(loop=)`, where
    `fd` stays open while the task is sent); `PoolResult.replied` says whether it was. A worker
    that cannot write the whole frame at once shuts the socket down: never half a reply."""

    fd: int
    frame: bytes


@dataclass(eq=False)
class PoolJob:
    """A submitted batch. `result()` waits; `cancel()` abandons it (its busy workers are
    stopped and replaced, so their CCXs are free again at once); `withdraw()` drops it only
    while no worker has been given any of it.

    It is started once a worker has been given one of its pieces (`started_at`): a dispatcher
    thread that took the piece from its worker's queue, or a loop the worker was lent to
    (`Dispatcher.lend`). That hand-over (`_take`) and `withdraw()` are decided under `_lock`,
    one step each, so a piece is either given to a worker or the job dropped, never both."""

    kernel: str
    _future: Future[PoolResult] = field(default_factory=Future)
    # tasks not done yet: set once before any dispatcher sees the job, then decremented under
    # _lock by the dispatcher threads that finish them
    _pending: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _finish: Callable[[PoolJob], None] | None = None
    queued_at: float = field(default_factory=time.perf_counter)
    # set by the first `_take`, under _lock
    started_at: float | None = None
    # pieces handed to a worker so far (a piece lost with its worker and run again counts
    # twice), and whether `withdraw()` dropped the job: both under _lock
    _given: int = 0
    _dropped: bool = False
    replied: bool = False  # its worker wrote its Reply
    replying: bool = False  # its worker holds its Reply now (sent with the task, not done)

    @property
    def future(self) -> Future[PoolResult]:
        """The outcome as a `concurrent.futures.Future` (for `asyncio.wrap_future`); cancel the
        job with `cancel()`, which also stops its busy workers."""
        return self._future

    @overload
    def settled_in(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[PoolResult]: ...

    @overload
    def settled_in(
        self, loop: asyncio.AbstractEventLoop, convert: Callable[[PoolResult], T]
    ) -> asyncio.Future[T]: ...

    def settled_in(
        self, loop: asyncio.AbstractEventLoop, convert: Callable[[PoolResult], Any] | None = None
    ) -> asyncio.Future[Any]:
        """The outcome as a future of `loop`, whose thread calls this (`convert`ed, where
        given: the caller's own result type, with no second future to hop through). A job
        that ends in that thread (run there directly, see `_direct`) settles it at once; one
        that ends in a dispatcher thread, through `call_soon_threadsafe`, as
        `asyncio.wrap_future` settles both (a write to the loop's wake-up pipe and one more
        turn of the loop). Cancelling it cancels the job."""
        settled: asyncio.Future[Any] = loop.create_future()
        home = threading.get_ident()

        def copy(done: Future[PoolResult]) -> None:
            if settled.done():
                return
            if done.cancelled():
                settled.cancel()
            elif (exc := done.exception()) is not None:
                settled.set_exception(exc)
            else:
                result = done.result()
                settled.set_result(result if convert is None else convert(result))

        def ended(done: Future[PoolResult]) -> None:
            if threading.get_ident() == home:
                copy(done)
            else:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    loop.call_soon_threadsafe(copy, done)

        self._future.add_done_callback(ended)
        settled.add_done_callback(lambda f: self.cancel() if f.cancelled() else None)
        return settled

    def result(self, timeout: float | None = None) -> PoolResult:
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"the batch did not finish within {timeout} s") from None

    def done(self) -> bool:
        return self._future.done()

    @property
    def cancelled(self) -> bool:
        return self._future.cancelled()

    def cancel(self) -> None:
        # The pool stops the busy workers from a callback on the future, so that cancelling
        # the future itself (asyncio.wrap_future does, when its awaiter is cancelled) abandons
        # the work just the same.
        self._future.cancel()

    def withdraw(self) -> bool:
        """Drop the job if no worker has been given any of its pieces: True, and the job is
        cancelled with no worker stopped (none holds any of it; the pool takes its pieces off
        the queues, and a piece a dispatcher thread took meanwhile is not given to its worker).
        False: it has started, and runs on untouched (to its end, or until `cancel()`)."""
        with self._lock:
            if self._given:
                return False
            self._dropped = True
        self.cancel()  # outside _lock: the pool's callback takes the workers' locks
        return True

    def _take(self) -> bool:
        """A worker is given one of the job's pieces now, unless the job was withdrawn or has
        ended (False: the piece is skipped). Called under the worker's lock, so that a
        `cancel()` either comes first or finds the piece the worker's current one."""
        with self._lock:
            if self._dropped or self._future.done():
                return False
            self._given += 1
            if self.started_at is None:
                self.started_at = time.perf_counter()
            return True

    def _untake(self) -> None:
        """A piece `_take`n went back to a queue with nothing of it sent (a loan that could not
        start): the job is as it was before that hand-over."""
        with self._lock:
            self._given -= 1
            if not self._given:
                self.started_at = None

    def _piece_done(self) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last and self._finish is not None:
            self._finish(self)

    def _fail(self, exc: BaseException) -> None:
        # a race with cancel() or another failure: the first outcome wins
        with contextlib.suppress(InvalidStateError):
            self._future.set_exception(exc)

    def _succeed(self, result: PoolResult) -> None:
        with contextlib.suppress(InvalidStateError):  # cancelled or failed meanwhile
            self._future.set_result(result)


@dataclass(eq=False)
class Task:
    """One worker's share of a job: its pieces, in one message. `spec` lacks `buffers` and
    `forget`, which depend on what the worker it goes to has mapped. `caller`: who asked (the
    service's `Caller`, any hashable name), whose tasks take turns with other callers'."""

    id: int
    job: PoolJob
    spec: TaskSpec
    buffers: list[SharedBuffer]
    cost: int
    attempts: int = 0  # times a worker died under it; changed by the one party running it
    caller: Hashable = None


@dataclass(frozen=True)
class LostOnLoan:
    """Queued by `Dispatcher.give_back` when the worker died while lent: wakes the dispatcher
    thread to replace it (why is the dispatcher's `lost_why`). Taken before any task."""


@dataclass(frozen=True)
class StopDispatching:
    """Queued by `Dispatcher.stop_dispatching`: the dispatcher thread ends. Taken once no task
    is left."""


#: what a worker's queue holds
Queued = Task | LostOnLoan | StopDispatching


class TaskQueue(queue.Queue[Queued]):
    """Tasks waiting for one worker, taken round-robin between their callers: a caller's flood
    delays another caller's task by at most one task per flooding caller; `LostOnLoan` comes
    out before the tasks, `StopDispatching` after them. `cost` is the tasks' summed, kept under
    the queue's own `mutex` as tasks come and go."""

    def _init(self, maxsize: int) -> None:
        # callers in turn order: the one served goes to the back; a new one joins at the back
        self._tasks: dict[Hashable, deque[Task]] = {}
        self._lost = 0  # LostOnLoan messages queued
        self._stops = 0  # StopDispatching messages queued
        self._count = 0
        self.cost = 0

    def _qsize(self) -> int:
        return self._count + self._lost + self._stops

    def _put(self, item: Queued) -> None:
        if isinstance(item, StopDispatching):
            self._stops += 1
        elif isinstance(item, LostOnLoan):
            self._lost += 1
        else:
            self._tasks.setdefault(item.caller, deque()).append(item)
            self._count += 1
            self.cost += item.cost

    def _get(self) -> Queued:
        if self._lost:
            self._lost -= 1
            return LostOnLoan()
        if self._tasks:
            return self._next_task()
        self._stops -= 1
        return StopDispatching()

    def _next_task(self) -> Task:
        caller = next(iter(self._tasks))
        mine = self._tasks.pop(caller)
        task = mine.popleft()
        if mine:
            self._tasks[caller] = mine  # its next task waits for the others' turns
        self._count -= 1
        self.cost -= task.cost
        return task

    @property
    def load(self) -> int:
        with self.mutex:
            return self.cost

    def drop(self, job: PoolJob) -> int:
        """Take `job`'s queued tasks off the queue (it was cancelled); how many there were."""
        with self.mutex:
            dropped = 0
            for caller in list(self._tasks):
                mine = self._tasks[caller]
                kept = deque(t for t in mine if t.job is not job)
                if len(kept) == len(mine):
                    continue
                for task in mine:
                    if task.job is job:
                        dropped += 1
                        self.cost -= task.cost
                if kept:
                    self._tasks[caller] = kept  # its turn unchanged
                else:
                    del self._tasks[caller]
            self._count -= dropped
            return dropped

    def take_all(self) -> list[Task]:
        """Take the tasks queued, in turn order, leaving `LostOnLoan` and `StopDispatching`."""
        with self.mutex:
            moved: list[Task] = []
            while self._tasks:
                moved.append(self._next_task())
            return moved
