"""A job run with a `Reply` (`submit_batch(loop=, reply=)`): its worker writes the frame to the
caller's socket once the work is done, before it tells the pool, whole or not at all; a job that
is not run on one worker from the loop never is answered so; nothing a reply's socket does (its
reader gone, its buffer full, not a socket at all) costs the worker or the job."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from tests.pool.jobs import small_batch
from tests.reference import assert_close_to_reference
from zen_mla.attention import select_kernel, validate
from zen_mla.pool import PoolConfig, PoolJob, Reply, WorkerPool

pytestmark = pytest.mark.slow

FRAME = b"\x00\x00\x00\x0b" + b'{"ok":true}'


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(PoolConfig(workers=1, heartbeat_interval=0.2, heartbeat_timeout=1.5)) as p:
        yield p


def _submit(pool: WorkerPool, tensors, reply: Reply, loop=None) -> PoolJob:
    batch = validate(*tensors, None, causal=True, scale=None)
    chosen = select_kernel("auto", batch.q.dtype, return_lse=False)
    return pool.submit_batch(batch, chosen.name, return_lse=False, loop=loop, reply=reply)


def _run(pool: WorkerPool, tensors, reply: Reply):
    async def go():
        job = _submit(pool, tensors, reply, asyncio.get_running_loop())
        return await job.settled_in(asyncio.get_running_loop())

    return asyncio.run(go())


def test_the_worker_writes_the_reply_before_the_job_is_done(pool):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        tensors = small_batch()
        result = _run(pool, tensors, Reply(ours.fileno(), FRAME))
        assert result.replied
        # written before the worker's Done reached the loop: already waiting, whole
        theirs.setblocking(False)
        assert theirs.recv(1 << 16) == FRAME
        assert_close_to_reference(*tensors, None, True, result.out)
        ours.send(b"x")  # the caller's socket is still the caller's, open
        assert theirs.recv(1) == b"x"
        result.release()


def test_a_job_not_run_from_the_loop_is_answered_by_the_caller(pool):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        job = _submit(pool, small_batch(), Reply(ours.fileno(), FRAME))  # no loop: queued
        result = job.result(30)
        assert not result.replied
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(1)
        result.release()


def test_a_failing_task_writes_no_reply(pool):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        q, k, v, cu = small_batch()
        batch = validate(q, k, v, cu, None, causal=True, scale=None)

        async def go():
            loop = asyncio.get_running_loop()
            job = pool.submit_batch(
                batch,
                "no-such-kernel",
                return_lse=False,
                loop=loop,
                reply=Reply(ours.fileno(), FRAME),
            )
            return await job.settled_in(loop)

        with pytest.raises(Exception, match="no-such-kernel"):
            asyncio.run(go())
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(1)
    assert _run_ok(pool)  # and the worker takes the next task


def _run_ok(pool: WorkerPool) -> bool:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        result = _run(pool, small_batch(3), Reply(ours.fileno(), FRAME))
        result.release()
        return result.replied and theirs.recv(1 << 16) == FRAME


def test_a_reader_gone_costs_neither_the_job_nor_the_worker(pool):
    pid = pool.workers()[0]["pid"]
    ours, theirs = socket.socketpair()
    theirs.close()
    with ours:
        result = _run(pool, small_batch(), Reply(ours.fileno(), FRAME))
        assert result.replied  # the job is done; nobody was there to read
        result.release()
    assert _run_ok(pool)
    assert pool.workers()[0]["pid"] == pid and pool.workers()[0]["restarts"] == 0


def test_a_socket_that_cannot_take_the_whole_frame_is_shut_down_never_half_written(pool):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        filled = 0
        while True:  # a caller that does not read its replies: its buffer full
            try:
                filled += ours.send(b"\xff" * 4096)
            except BlockingIOError:
                break
        big = b"\x00\x01\x00\x00" + b"z" * 65536
        result = _run(pool, small_batch(), Reply(ours.fileno(), big))
        assert result.replied
        result.release()
        theirs.setblocking(True)
        theirs.settimeout(10)
        got = bytearray()
        while chunk := theirs.recv(1 << 16):  # until the end the worker made
            got += chunk
        assert len(got) >= filled
        assert bytes(got[:filled]) == b"\xff" * filled
        assert b"z" * 65536 not in bytes(got)  # never the whole frame after a cut one
        with pytest.raises(OSError):
            ours.send(b"more")  # shut down for the caller too: the connection ended


def test_a_descriptor_that_is_not_a_socket_is_closed_and_costs_nothing(pool):
    r, w = os.pipe()
    try:
        result = _run(pool, small_batch(), Reply(r, FRAME))
        assert result.replied
        result.release()
    finally:
        os.close(r)
        os.close(w)
    assert _run_ok(pool)
