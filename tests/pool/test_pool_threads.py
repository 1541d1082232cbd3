"""A task of less work than `min_thread_cost` runs on one of its worker's threads: the others
are not woken (nor left spinning on cores the caller may need); a bigger one runs on all. Seen
from outside, in the CPU time /proc counts for each of the worker's threads."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tests.reference import assert_close_to_reference
from zen_mla.attention import select_kernel, validate
from zen_mla.pool import PoolConfig, WorkerPool
from zen_mla.pool import _process as process

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: a worker of two threads"
    ),
]


def _tensors(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, 16, 192, generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(tokens, 16, 128, generator=g, dtype=torch.bfloat16)
    return q, k, v, torch.tensor([0, tokens], dtype=torch.int32)


def _others_ticks(pid: int) -> int:
    """CPU ticks (user + system) of every thread of `pid` but its main one."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        if int(task.name) != pid:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total


def _run(pool: WorkerPool, tensors) -> None:
    batch = validate(*tensors, None, causal=True, scale=None)
    chosen = select_kernel("auto", batch.q.dtype, return_lse=False)
    result = pool.submit_batch(batch, chosen.name, return_lse=False).result(120)
    assert_close_to_reference(*tensors, None, True, result.out)
    result.release()


def test_small_tasks_run_on_one_thread_big_ones_on_all(monkeypatch):
    sent = []
    original = process.WorkerProcess.send

    def spy(self, msg, fds=()):
        sent.append(msg)
        return original(self, msg, fds)

    monkeypatch.setattr(process.WorkerProcess, "send", spy)
    with WorkerPool(PoolConfig(workers=1)) as pool:
        worker = pool.workers()[0]
        assert worker["threads"] >= 2
        small, big = _tensors(4), _tensors(2048, seed=1)
        _run(pool, small)
        time.sleep(0.5)  # any thread still spinning from start-up goes to sleep
        before = _others_ticks(worker["pid"])
        for _ in range(300):
            _run(pool, small)
        assert _others_ticks(worker["pid"]) - before <= 1  # no other thread woke
        assert {m.spec.threads for m in sent} == {1}  # 16 x 4 x 5 / 2 head-pairs: one thread

        before = _others_ticks(worker["pid"])
        for _ in range(3):
            _run(pool, big)
        assert sent[-1].spec.threads == 0  # all the worker's threads
        assert _others_ticks(worker["pid"]) - before >= 2  # they shared the work
