"""What a worker process imports before it has pinned itself: nothing that loads torch."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: what spawn's child does with the target (unpickle `_worker.main`: import its module) and then
#: with a task (unpickle a `RunTask`), in an interpreter of its own
CHILD = """
import pickle, sys
import zen_mla.pool._worker
assert "torch" not in sys.modules, "importing the worker loaded torch"
msg = pickle.loads(sys.stdin.buffer.read())
assert "torch" not in sys.modules, "unpickling a task loaded torch"
print(type(msg).__name__, len(msg.spec.pieces))
"""


@pytest.mark.slow  # starts an interpreter
def test_a_worker_loads_torch_only_after_its_setup():
    from zen_mla.pool._messages import BufferUse, RunTask, TaskSpec, TensorRef
    from zen_mla.pool._schedule import schedule

    ref = TensorRef(1, 0, (4, 2, 8), (16, 8, 1), "bfloat16")
    pieces = tuple(schedule((0, 4), (0, 4), 2, True, 1)[0])
    spec = TaskSpec("torch", True, 0.5, ref, ref, ref, ref, None, pieces, (BufferUse(1, 64, True),))
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=pickle.dumps(RunTask(7, spec), protocol=pickle.HIGHEST_PROTOCOL),
        capture_output=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().split() == ["RunTask", str(len(pieces))]
