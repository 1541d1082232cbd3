"""The worker process: pinned to its CPUs, it runs attention pieces on shared-memory tensors.

This module imports nothing heavy at the top: the CPU affinity and thread environment must be
in place before torch (and its OpenMP runtime) loads.
"""

from __future__ import annotations

import mmap
import os
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any


def _setup(cpus: tuple[int, ...], threads: int) -> None:
    os.sched_setaffinity(0, cpus)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ZENDNN_NUM_THREADS"):
        os.environ[var] = str(threads)


def main(conn: Connection, cpus: tuple[int, ...], threads: int, warm_zentorch: bool) -> None:
    """Entry point of a spawned worker. Messages (tuples, never tensor bytes):

    in:  ("run", task_id, spec) followed by one descriptor per spec["buffers"] entry not
         mapped yet; ("ping", n); ("stop",). spec["forget"]: buffers to unmap.
    out: ("ready", pid); ("done", task_id); ("error", task_id, type name, message); ("pong", n)
    """
    _setup(cpus, threads)
    import torch

    torch.set_num_threads(threads)
    if warm_zentorch:
        from zen_mla._status import zentorch_op

        zentorch_op()  # import zentorch now, not on the first request
    conn.send(("ready", os.getpid()))
    # Mappings stay across tasks (the supervisor reuses buffers), so a task maps nothing new and
    # touches no page table; the supervisor says which to forget when it frees a buffer.
    maps: dict[int, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the supervisor is gone
        if msg[0] == "stop":
            return
        if msg[0] == "ping":
            conn.send(("pong", msg[1]))
            continue
        _, task_id, spec = msg
        for buf_id in spec["forget"]:
            maps.pop(buf_id, None)
        try:
            for buf_id, nbytes, sent in spec["buffers"]:
                if sent:
                    maps[buf_id] = _map(recv_handle(conn), nbytes)
            _run(spec, maps)
        except Exception as exc:  # reported, never fatal: the next task gets a clean slate
            conn.send(("error", task_id, type(exc).__name__, str(exc)))
        else:
            conn.send(("done", task_id))


def _map(fd: int, nbytes: int) -> Any:
    """A uint8 tensor over the buffer behind `fd` (closed here; the mapping keeps it)."""
    import torch

    try:
        m = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    return torch.frombuffer(m, dtype=torch.uint8)


def _run(spec: dict[str, Any], whole: dict[int, Any]) -> None:
    from zen_mla._attention import attend
    from zen_mla._ragged import RaggedBatch
    from zen_mla.kernels import KERNELS

    from ._shm import view

    q, k, v, out = (
        view(whole[r.buffer], r) for r in (spec["q"], spec["k"], spec["v"], spec["out"])
    )
    lse = view(whole[spec["lse"].buffer], spec["lse"]) if spec["lse"] is not None else None
    kernel = KERNELS[spec["kernel"]]
    for piece in spec["pieces"]:
        h = slice(piece.h0, piece.h1)
        qs, ks = slice(piece.q_lo, piece.q_hi), slice(piece.kv_lo, piece.kv_hi)
        batch = RaggedBatch(
            q[qs, h], k[ks, h], v[ks, h], piece.q_cu, piece.kv_cu, spec["causal"], spec["scale"]
        )
        attend(
            batch,
            kernel,
            return_lse=lse is not None,
            out=out[qs, h],
            lse=lse[h, qs] if lse is not None else None,
        )
