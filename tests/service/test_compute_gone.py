"""`compute.compute` when the client has hung up: a job its worker answers (a region-socket
call's `Reply`) is decided by its outcome, since the client may have read that answer before
the service reads the worker's Done; any other job is a hang-up (499) at once. A real engine
with one worker; the hang-up is a `gone` future already done, so no timing decides it."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

import zen_mla
from service.compute import compute
from service.forms.base import ClientGoneError, RequestRecord
from service.held import Held
from service.settings import Settings
from service.state import ServiceState
from tests.processes import wait_for
from zen_mla.deadline import Deadline
from zen_mla.engine import EngineConfig, PoolConfig, PrefillEngine, Reply, SharedBuffer

pytestmark = pytest.mark.slow

FRAME = b"\x00\x00\x00\x05hello"


@pytest.fixture(scope="module")
def engine():
    with PrefillEngine(EngineConfig(PoolConfig(workers=1))) as e:
        yield e


def _placed(engine: PrefillEngine) -> tuple[dict[str, torch.Tensor], SharedBuffer]:
    g = torch.Generator().manual_seed(0)
    shapes = {"q": (5, 4, 64), "k": (5, 4, 64), "v": (5, 4, 32)}
    buf = engine.buffer(1 << 20)
    placed, at = {}, 0
    for name, shape in shapes.items():
        t = torch.randn(*shape, generator=g)
        placed[name] = buf.tensor(at, shape, torch.float32).copy_(t)
        at += t.nbytes
    placed["q_cu_seq_lens"] = torch.tensor([0, 2, 5], dtype=torch.int32)
    return placed, buf


def _hung_up_compute(engine: PrefillEngine, reply_to: socket.socket | None):
    """`compute` of one small job whose client is gone before it starts; its result, or the
    exception it raised."""
    state = ServiceState(Settings(), engine=engine)
    placed, buf = _placed(engine)
    prepared = engine.prepare(placed)
    reply = Reply(reply_to.fileno(), FRAME) if reply_to is not None else None

    async def main():
        gone = asyncio.get_running_loop().create_future()
        gone.set_result(None)  # the client's socket ended
        record = RequestRecord("socket", time.perf_counter(), Deadline(state.settings.deadline_s))
        held = Held(engine, state.admission.admit_read(0))
        try:
            result = await compute(state, gone, prepared, record, held, inputs=buf, reply=reply)
            return result, placed
        finally:
            if held.ticket is not None:  # a hang-up's work holds it until that work ends
                held.ticket.close()

    return asyncio.run(main())


def test_a_job_its_worker_answers_is_decided_by_its_outcome(engine):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        result, placed = _hung_up_compute(engine, ours)
        assert result.replied
        assert theirs.recv(64) == FRAME  # the client had its answer
        expected = zen_mla.ragged_attention(
            placed["q"], placed["k"], placed["v"], placed["q_cu_seq_lens"]
        )
        assert torch.allclose(result.out, expected, atol=1e-5)
        result.release()


def test_any_other_job_is_a_hang_up(engine):
    """The one worker is held by a long job meanwhile, so the hung-up job is still queued when
    the hang-up is seen: its answer cannot win the race (on an idle worker a 5-token job may
    be answered in the very turn of the loop that sees the hang-up, and count as answered)."""
    g = torch.Generator().manual_seed(1)
    qk = torch.randn(4096, 16, 192, generator=g)
    cu = torch.tensor([0, 4096], dtype=torch.int32)
    long = engine.run(engine.prepare({"q": qk, "k": qk, "v": qk[..., :128], "q_cu_seq_lens": cu}))
    # the worker has taken it
    wait_for(lambda: long.started_at is not None, 30, "the long job never started", 0.001)
    try:
        with pytest.raises(ClientGoneError):
            _hung_up_compute(engine, None)
        assert not long.done(), "the long job ended first: the case did not hold"
    finally:
        long.result(60).release()
