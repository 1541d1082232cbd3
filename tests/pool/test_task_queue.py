"""A worker's queue takes tasks round-robin between callers: one caller's flood delays
another's task by at most one task per flooding caller; a worker lost while lent is replaced
before any task, and the dispatcher stops once the tasks are done; a cancelled job's tasks
leave it at once."""

from __future__ import annotations

from zen_mla.pool._job import LostOnLoan, PoolJob, StopDispatching, Task, TaskQueue


def _task(caller: object, n: int, cost: int = 1, job: PoolJob | None = None) -> Task:
    job = job or PoolJob(kernel="torch")
    return Task(n, job, None, [], cost, caller=caller)  # type: ignore[arg-type]


def _drain(q: TaskQueue) -> list[object]:
    taken = []
    while q.qsize():
        item = q.get_nowait()
        taken.append(item if not isinstance(item, Task) else (item.caller, item.id))
    return taken


def test_a_late_client_waits_one_task_per_flooding_client():
    q = TaskQueue()
    for n in range(50):
        q.put(_task("flood-a", n))
    for n in range(50):
        q.put(_task("flood-b", 100 + n))
    q.put(_task("late", 999))
    order = _drain(q)
    assert order.index(("late", 999)) == 2  # a's first, b's first, then its own
    assert order[:6] == [
        ("flood-a", 0),
        ("flood-b", 100),
        ("late", 999),
        ("flood-a", 1),
        ("flood-b", 101),
        ("flood-a", 2),
    ]


def test_one_clients_tasks_keep_their_order_and_the_cost_follows():
    q = TaskQueue()
    for n in range(5):
        q.put(_task("only", n, cost=10))
    assert q.load == 50 and q.qsize() == 5
    q.get_nowait()
    assert q.load == 40
    assert [t.id for t in q.take_all()] == [1, 2, 3, 4]
    assert q.load == 0 and q.qsize() == 0


def test_a_lost_loan_comes_first_and_a_stop_after_the_tasks():
    q = TaskQueue()
    q.put(_task("a", 1))
    q.put(StopDispatching())
    q.put(LostOnLoan())
    q.put(_task("b", 2))
    q.put(LostOnLoan())
    assert q.qsize() == 5
    assert _drain(q) == [LostOnLoan(), LostOnLoan(), ("a", 1), ("b", 2), StopDispatching()]


def test_take_all_leaves_lost_loans_and_stops():
    q = TaskQueue()
    q.put(_task("a", 1))
    q.put(LostOnLoan())
    q.put(StopDispatching())
    q.put(_task("b", 2))
    assert [(t.caller, t.id) for t in q.take_all()] == [("a", 1), ("b", 2)]
    assert _drain(q) == [LostOnLoan(), StopDispatching()]


def test_dropping_a_job_takes_its_tasks_only_and_keeps_the_turns():
    q = TaskQueue()
    gone, kept = PoolJob(kernel="torch"), PoolJob(kernel="torch")
    q.put(_task("a", 1, cost=10, job=gone))
    q.put(_task("b", 2, cost=20, job=kept))
    q.put(_task("a", 3, cost=30, job=kept))
    q.put(_task("c", 4, cost=40, job=gone))
    q.put(StopDispatching())
    assert q.drop(gone) == 2
    assert q.load == 50 and q.qsize() == 3
    assert q.drop(gone) == 0
    assert _drain(q) == [("a", 3), ("b", 2), StopDispatching()]
