"""One task run on a lent worker from an event loop, with no thread between the loop and the worker.

Through the dispatcher thread a small call costs four wake-ups and two switches of the GIL: the
loop hands the task to the thread, the thread sends it, the worker's answer wakes the thread,
and the thread wakes the loop. Here the loop's own thread sends the task (`Dispatcher.send`)
and reads the answer when the worker's pipe is readable: two wake-ups, the least a process hop
can cost. The loop watches a duplicate of the pipe's descriptor, so that a pipe closed under it
(the pool shutting down) never leaves the loop watching a number reused since; where it cannot
make one (out of descriptors) the task is queued for the dispatcher thread instead.

A worker that dies mid-task closes its end of the pipe: the answer reads as end-of-file, the
task goes back to the pool as any task lost with a worker, and the dispatcher thread replaces
the worker (`Dispatcher.give_back`). A silent one is marked stuck by the dispatcher thread, and
a cancelled job's worker is killed as usual (`Dispatcher.cancel`).
"""

from __future__ import annotations

import asyncio
import os

from ._dispatch import Dispatcher, Lost, Outcome, worker_lost
from ._job import Reply, Task
from ._messages import Done, ToSupervisor
from ._process import WorkerProcess

__all__ = ["DirectRun"]


class DirectRun:
    """`task` on `proc`, lent by `dispatcher`, sent and answered in `loop`'s thread (`start()`
    is called there); `reply`, where given, written by the worker once the task is done. A task
    lost with its worker goes back to the pool without it: the caller answers."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        proc: WorkerProcess,
        task: Task,
        loop: asyncio.AbstractEventLoop,
        reply: Reply | None = None,
    ) -> None:
        self._dispatcher, self._proc, self._task, self._loop = dispatcher, proc, task, loop
        self._reply = reply
        self._fd: int | None = None

    def start(self) -> bool:
        """Send the task; False, with nothing sent and the worker given back idle, when the
        loop cannot watch its pipe (out of descriptors, say): the caller queues it instead."""
        try:
            self._fd = os.dup(self._proc.conn.fileno())
            self._loop.add_reader(self._fd, self._readable)
        except Exception:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._dispatcher.give_back()
            self._task.job._untake()  # not started: nothing went out
            return False
        sent = self._dispatcher.send(self._proc, self._task, self._reply)
        if sent is not None:
            self._end(sent)
        elif self._reply is not None:
            self._task.job.replying = True
        return True

    def _readable(self) -> None:
        # One message a turn, read without asking the pipe first (`Connection.poll` builds a
        # selector each time, ~10 us): the loop watches the pipe level-triggered, so it calls
        # again at once while another message waits (a heartbeat come with the answer).
        try:
            msg: ToSupervisor = self._proc.recv()
        except (EOFError, OSError):
            self._end(Lost("died"))
            return
        answer = self._dispatcher.answer(self._task, msg)
        if answer is None:
            return  # a heartbeat
        if isinstance(answer, Done) and self._reply is not None:
            self._task.job.replied = True  # the worker wrote it before its Done
        self._end(answer)

    def _end(self, outcome: Outcome) -> None:
        self._task.job.replying = False  # done, failed, or lost with its worker
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        # given back first: a lost task is queued behind the replacement, and a next call
        # finds the worker idle
        self._dispatcher.give_back(worker_lost(outcome))
        self._dispatcher.settle(self._task, outcome)
