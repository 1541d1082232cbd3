"""What no module handling a request or a task may do, and the defaults that keep it safe."""

from __future__ import annotations

import re
from pathlib import Path

from service.cli import build_parser
from service.settings import Settings
from zen_mla import wire

ROOT = Path(__file__).resolve().parents[1]
#: every module of both packages: each handles a request or a task, or may come to
MODULES = sorted([*(ROOT / "service").rglob("*.py"), *(ROOT / "zen_mla").rglob("*.py")])
#: `.recv()` with no size: multiprocessing's `Connection.recv`, which unpickles
UNSAFE = re.compile(r"\b(pickle|torch\.load|eval\(|exec\(|marshal|shelve|yaml\.load\()|\.recv\(\)")
#: The one place where bytes are unpickled: the pool's supervisor and the workers it spawned,
#: over the socket pair `multiprocessing.Pipe` made for each (multiprocessing's spawn unpickles
#: the worker's entry point over another). Its messages are the dataclasses of
#: zen_mla/pool/_messages.py, which name shared-memory tensors by buffer and offset: no byte of a
#: request is pickled. Per file: why, and the lines allowed there.
PRIVATE_PIPE = {
    "zen_mla/pool/_worker.py": (
        "a worker reads its own supervisor's RunTask, Forget and Stop",
        {"import pickle", "msg: RunTask | Forget | Stop = pickle.loads(_recv_exact(sock, n))"},
    ),
    "zen_mla/pool/_process.py": (
        "the supervisor pickles a task for its worker and reads the worker's Ready, Done,"
        " Failed and Heartbeat (WorkerProcess.recv)",
        {
            "import pickle",
            "payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)",
            "msg: ToSupervisor = self.conn.recv()",
            "msg: ToSupervisor | None = self.recv()",
        },
    ),
    "zen_mla/pool/_dispatch.py": (
        "a worker's dispatcher reads a task's answer and an idle worker's heartbeats"
        " (WorkerProcess.recv)",
        {"msg: ToSupervisor = proc.recv()"},
    ),
    "zen_mla/pool/_direct.py": (
        "an event loop running a task on a lent worker reads its answer (WorkerProcess.recv)",
        {"msg: ToSupervisor = self._proc.recv()"},
    ),
}


def test_the_scan_covers_every_module_that_handles_a_request_or_a_task():
    names = {path.relative_to(ROOT).as_posix() for path in MODULES}
    assert {
        "service/app.py",
        "service/body.py",
        "zen_mla/wire/safetensors.py",
        "zen_mla/wire/regions_json.py",
        "zen_mla/regions/server.py",
        "zen_mla/engine.py",
        "zen_mla/pool/_supervisor.py",
        "zen_mla/pool/_dispatch.py",
        "zen_mla/pool/_process.py",
        "zen_mla/pool/_shm.py",
        "zen_mla/pool/_worker.py",
    } <= names
    assert set(PRIVATE_PIPE) <= names


def test_nothing_unpickles_but_the_pool_over_its_private_pipe():
    found: dict[str, set[str]] = {}
    for path in MODULES:
        name = path.relative_to(ROOT).as_posix()
        _why, allowed = PRIVATE_PIPE.get(name, ("", set()))
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if UNSAFE.search(line):
                assert line.strip() in allowed, f"{name}:{n}: {line.strip()}"
                found.setdefault(name, set()).add(line.strip())
    for name, (why, allowed) in PRIVATE_PIPE.items():  # none allowed that the code lost
        assert found.get(name) == allowed, (
            f"{name} ({why}): stale {allowed - found.get(name, set())}"
        )


def test_binds_to_loopback_unless_told():
    assert Settings().host == "127.0.0.1"
    args = build_parser().parse_args(["serve"])
    assert args.host is None  # no flag: the setting's default stands


def test_caps():
    assert wire.MAX_HEADER_BYTES == 64 << 10
    assert {"q", "k", "v", "q_cu_seq_lens", "kv_cu_seq_lens"} == wire.REQUEST_TENSORS
    s = Settings()
    assert s.max_body_bytes == 1 << 30 and s.max_queue >= 1 and s.deadline_s == 60
    assert s.api_token is None
