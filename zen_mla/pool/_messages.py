"""The messages between the supervisor and a worker process, and what a task names.

Only the standard library is imported here: a worker unpickles these before it has set its CPU
affinity and thread environment, and torch must not load before that.

Plain frozen dataclasses, not `slots=True` ones: the pipe's serializer saves and restores a
plain one's `__dict__` in C, a slotted one field by field through Python (`RunTask` of a 1-token
call: 16 µs to write and 15 µs to read slotted, 7.5 and 7.5 plain; one of each a call).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BufferUse",
    "Done",
    "Failed",
    "Forget",
    "Heartbeat",
    "Latent",
    "Piece",
    "Ready",
    "RunTask",
    "Stop",
    "TaskSpec",
    "TensorRef",
    "ToSupervisor",
    "ToWorker",
]


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor lies in a shared buffer, in a form a pipe carries (no tensor bytes)."""

    buffer: int  # SharedBuffer.id
    offset: int  # bytes from the buffer start to element 0
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # "bfloat16", ...


@dataclass(frozen=True)
class Piece:
    """Requests `[r0, r1)`, heads `[h0, h1)`. Token ranges are absolute; `q_cu`/`kv_cu` are the
    requests' offsets relative to `q_lo`/`kv_lo`. `cost` in head x (query, key) pairs."""

    r0: int
    r1: int
    h0: int
    h1: int
    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int
    q_cu: tuple[int, ...]
    kv_cu: tuple[int, ...]
    cost: int


@dataclass(frozen=True)
class BufferUse:
    """A shared buffer a task reads or writes; `sent`: its descriptor rides with the message
    (the worker has not mapped it yet). A client's region is mapped without `populate`: its
    untouched pages stay the client's to fault in."""

    id: int  # SharedBuffer.id
    nbytes: int
    sent: bool
    populate: bool = True  # fault its pages in when mapping it (the pool's own buffers)


@dataclass(frozen=True)
class Latent:
    """A batch's keys and values as MLA's latent cache (`attention.latent`): `kv_c` `[Tk, R]`,
    `k_pe` `[Tk, P]` and the layer's `w_kv_b` `[H * (Dn + Dv), R]`, attended in `form` and
    `precision` (`latent_attention`'s)."""

    kv_c: TensorRef
    k_pe: TensorRef
    w_kv_b: TensorRef
    form: str
    precision: str = "auto"


@dataclass(frozen=True)
class TaskSpec:
    """One worker's share of a batch: `pieces` of it over `q` and `k`, `v` (or the `latent`
    cache: then `k` and `v` are None), written to `out` (and `lse`), on `threads` of the
    worker's (0: all of them). `forget`: buffer ids the worker is to
    unmap (freed by the supervisor). `reply`: a frame the worker writes, once the task is done
    and before its `Done`, to the socket whose descriptor rides last with the message (the
    caller's, answered with no hop back here)."""

    kernel: str
    causal: bool
    scale: float
    q: TensorRef
    k: TensorRef | None
    v: TensorRef | None
    out: TensorRef
    lse: TensorRef | None
    latent: Latent | None = None
    pieces: tuple[Piece, ...] = ()
    buffers: tuple[BufferUse, ...] = ()
    forget: tuple[int, ...] = ()
    reply: bytes | None = None
    threads: int = 0


# -- supervisor -> worker --------------------------------------------------------------------


@dataclass(frozen=True)
class RunTask:
    """Run `spec`; one descriptor is attached per `spec.buffers` entry marked `sent`, in order,
    then the reply's socket where `spec.reply` is set."""

    task_id: int
    spec: TaskSpec


@dataclass(frozen=True)
class Forget:
    """Unmap these buffers (freed by the supervisor) now; sent to an idle worker, unanswered."""

    buffers: tuple[int, ...]


@dataclass(frozen=True)
class Stop:
    """Exit now."""


# -- worker -> supervisor --------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """torch is loaded: the worker takes tasks."""

    pid: int


@dataclass(frozen=True)
class Done:
    """The task is done (and its `spec.reply` written, where it had one)."""

    task_id: int


@dataclass(frozen=True)
class Failed:
    """The task raised; the worker keeps none of its buffers mapped. `error_type` is the
    exception's class name; for an InvalidInputError, `fields` are its (name, expected, got,
    hint), so the pool raises it again as the same class with the same parts."""

    task_id: int
    error_type: str
    message: str
    fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class Heartbeat:
    """A heartbeat, every `heartbeat_interval` s from the worker's watchdog thread."""

    n: int


ToWorker = RunTask | Forget | Stop
ToSupervisor = Ready | Done | Failed | Heartbeat
