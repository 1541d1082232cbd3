"""A request form: what a way in supplies to the one pipeline (`pipeline.serve`), and nothing
more. A form says what body it expects from the request's head (`expect`), how the body read
becomes tensors (or places) and options (`decode`), where the outputs go (`places`), a reply a
worker may write itself (`reply`), how its answer is written (`answer`) and how its errors are
(`refuse`). The pipeline calls it; it never calls the pipeline back. Admission, the body
reader, validation, the queue, the deadline, the hang-up rule, release, metrics and the log
line are the pipeline's: adding a form touches the form alone. (httpx's transports are the model: a
transport implements `handle_request`; the client owns the rest.)

    safetensors /prefill    forms/safetensors.py (also over MLA's latent cache)
    weight registration     forms/weight.py (keeps its body, or a copy of its place; computes
                            nothing)
    regions JSON /prefill   forms/regions.py (also over MLA's latent cache)
    region-socket call      forms/call.py (and a weight registered from a region)
    /v2 infer               kserve/infer.py
    /v2 shm registration    kserve/register.py (reads a body, computes nothing)
    gRPC ModelInfer         kserve/grpc_infer.py
    gRPC shm registration   kserve/grpc_infer.py (`GrpcRegisterForm`)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from zen_mla import ZenMLAError
from zen_mla.attention.select import KernelChoice
from zen_mla.deadline import Deadline
from zen_mla.engine import (
    OutputPlaces,
    PrefillEngine,
    PrefillRequest,
    PrefillResult,
    Reply,
    SharedBuffer,
)
from zen_mla.wire import PrefillOptions

from ..admission import Charge
from ..doors import Door
from ..held import Held
from ..settings import Settings

__all__ = ["ClientGoneError", "Computed", "Expect", "Form", "RequestRecord", "Work"]


class ClientGoneError(Exception):
    """The client closed the connection while its work ran, or before a form kept what it
    read (answered 499, for metrics)."""


A = TypeVar("A")


@dataclass
class RequestRecord:
    """One request as the log line and the metrics see it (the pipeline fills it; a form
    sets `request_id` as soon as it knows it, and `bytes_out` as it answers)."""

    route: str
    t0: float
    deadline: Deadline  # the service's: `deadline_s` from arrival
    request_id: str | None = None
    status: int = 500
    bytes_in: int = 0
    bytes_out: int = 0
    ingest_s: float = 0.0  # from the start until the request's bytes were in
    queue_s: float = 0.0
    compute_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Work:
    """A request read: its tensors by the contract's names (q, k, v, q_cu_seq_lens[,
    kv_cu_seq_lens]; or q, kv_c, k_pe, w_kv_b, ... over the latent cache), its options, and the
    buffers its tensors lie in (read there in place)."""

    tensors: Mapping[str, torch.Tensor]
    options: PrefillOptions
    inputs: SharedBuffer | Sequence[SharedBuffer] | None = None
    # buffers made for the inputs: given back with the body
    staging: SharedBuffer | Sequence[SharedBuffer] | None = None
    timeout: float | None = None  # the caller's seconds, where its request carries them
    # what the work borrowed (a registered weight): each call gives one back, with the body
    leases: Sequence[Callable[[], None]] = ()


@dataclass(frozen=True, slots=True)
class Computed:
    """The work done, as its answer writes it: the result's `out`, `lse`, `kernels` and
    `replied`; `release()` hands the result's memory back, then the bytes charged for it (from
    whichever thread sends the answer's last byte, or lets it go)."""

    result: PrefillResult
    charge: Charge

    @property
    def out(self) -> torch.Tensor:
        return self.result.out

    @property
    def lse(self) -> torch.Tensor | None:
        return self.result.lse

    @property
    def kernels(self) -> KernelChoice:
        return self.result.kernels

    @property
    def replied(self) -> bool:
        return self.result.replied

    def release(self) -> None:
        self.result.release()
        self.charge.close_soon()


@dataclass(frozen=True, slots=True)
class Expect:
    """The body a form expects, known from the request's head: at most `limit` bytes, landing
    at byte `lead` of its buffer (a form that knows where its tensors start aligns them so);
    `small`: read as bytes (a JSON), its buffer given back at once."""

    limit: int
    lead: int = 0
    small: bool = False


class Form(Generic[A]):
    """One request in one form; `A` is its answer (an HTTP response, a socket frame).
    `computes`: False for a form that only reads a body (a registration): `decode` returns None,
    no engine is asked to be ready and `answer` gets no result."""

    route: str = ""  # the metrics' and the log line's name
    computes: bool = True

    def expect(self, settings: Settings, door: Door) -> Expect:
        """The body expected, from the request's head (its checks raise here, before admission
        and before a byte of the body is read)."""
        raise NotImplementedError

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> Work | None:
        """The body read (a buffer of the engine's, or bytes where `Expect.small`) as the
        request's tensors and options; None for a form that computes nothing."""
        raise NotImplementedError

    def places(self, prepared: PrefillRequest) -> OutputPlaces | None:
        """Where the outputs go (checked against the validated request); None: a buffer of the
        engine's, answered from there."""
        return None

    def keep(self, held: Held) -> None:
        """For a form that computes nothing: take what it keeps past the request (a registered
        weight: the body's buffer and its charge, `Held.hand_out`) once its body is decoded."""

    def reply(self, prepared: PrefillRequest) -> Reply | None:
        """A reply its worker writes to the caller itself once the work is done, if any."""
        return None

    def explain(self, exc: ZenMLAError) -> None:
        """Raise a more precise error for `exc`, a worker's failure, where the form knows one."""

    async def answer(self, result: Computed | None, record: RequestRecord) -> A:
        """The answer to the work done (`result` is released by the answer once sent)."""
        raise NotImplementedError

    def refuse(self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]) -> A:
        """The answer to an error, in the form's own shape."""
        raise NotImplementedError

    def hung_up(self) -> A:
        """The answer nobody reads: the client hung up (counted as 499)."""
        raise NotImplementedError
