"""A job is given to a worker (`PoolJob._take`, by a dispatcher thread or a loan) or withdrawn
(`PoolJob.withdraw`, by a caller whose client hung up), never both and never neither, whichever
comes first; threads racing to do both show it."""

from __future__ import annotations

import threading

from zen_mla.pool._job import PoolJob


def test_a_job_given_to_a_worker_is_not_withdrawn():
    job = PoolJob(kernel="torch")
    assert job._take()
    assert job.started_at is not None
    assert not job.withdraw()
    assert not job.done()
    assert job._take()  # its other pieces still go out


def test_a_withdrawn_job_is_given_to_no_worker():
    job = PoolJob(kernel="torch")
    assert job.withdraw()
    assert job.cancelled
    assert not job._take()
    assert job.started_at is None


def test_a_piece_taken_back_unsent_leaves_the_job_not_started():
    job = PoolJob(kernel="torch")
    assert job._take()
    job._untake()
    assert job.started_at is None
    assert job.withdraw()


def test_a_cancelled_job_is_given_to_no_worker():
    job = PoolJob(kernel="torch")
    job.cancel()
    assert not job._take()


def test_racing_a_hand_over_and_a_withdrawal_one_wins():
    rounds = 2000
    jobs = [PoolJob(kernel="torch") for _ in range(rounds)]
    taken: list[bool] = [False] * rounds
    withdrawn: list[bool] = [False] * rounds
    start = threading.Barrier(2)

    def take() -> None:
        start.wait()
        for i, job in enumerate(jobs):
            taken[i] = job._take()

    def withdraw() -> None:
        start.wait()
        for i, job in enumerate(jobs):
            withdrawn[i] = job.withdraw()

    threads = [threading.Thread(target=take), threading.Thread(target=withdraw)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, job in enumerate(jobs):
        assert taken[i] != withdrawn[i], i
        assert (job.started_at is not None) == taken[i]
        assert job.cancelled == withdrawn[i]
