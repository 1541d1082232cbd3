"""`PUT /weights/{name}` (`WeightForm`): a layer's `kv_b_proj` weight, a safetensors file of one
tensor `w_kv_b`, read by the one body reader into the pool's shared memory like any body and
kept there as the caller's registered weight (`service.weights`): its buffer and its bytes'
charge leave the request in one step (`Held.hand_out`). Nothing is computed."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from fastapi import Response
from fastapi.responses import JSONResponse

from zen_mla import InvalidInputError, UnsupportedMediaTypeError, ZenMLAError, wire
from zen_mla.caller import Caller
from zen_mla.engine import PrefillEngine, SharedBuffer

from ..doors import Door
from ..held import Held
from ..problems import problem
from ..settings import Settings
from ..state import ServiceState, readiness
from ..weights import Weight, Weights
from .base import Computed, Expect, Form, RequestRecord

__all__ = ["WEIGHT_TENSORS", "WeightForm", "lend_weight", "weights_of"]

#: the tensors of a weight registration
WEIGHT_TENSORS = frozenset({"w_kv_b"})
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def weights_of(state: ServiceState) -> Weights:
    """The service's weights, once its engine is up (503 "starting" before)."""
    if state.weights is None:
        raise readiness(state).error(retry_after=5)
    return state.weights


def lend_weight(
    state: ServiceState,
    caller: Caller | None,
    name: str,
    where: str,
    tensors: dict[str, torch.Tensor],
) -> tuple[SharedBuffer, Callable[[], None]]:
    """The caller's weight `name` leased for one piece of work and added to `tensors` as
    `w_kv_b`: the buffer it lies in (read there in place) and what gives the lease back
    (NotFoundError naming `where` for a name the caller has not registered)."""
    weights = weights_of(state)
    weight = weights.lease(caller, name, where)
    tensors["w_kv_b"] = weight.tensor
    return weight.buffer, functools.partial(weights.give_back, weight)


class WeightForm(Form[Response]):
    """A weight registration: one tensor `w_kv_b` `[H * (Dn + Dv), R]`, kept in the buffer its
    body was read into; the answer its name, shape, dtype and bytes."""

    route = "weights"
    computes = False

    def __init__(self, state: ServiceState, media: str, name: str) -> None:
        self.state = state
        self.media = media
        self.name = name
        self.caller: Caller | None = None
        self.body: SharedBuffer | None = None
        self.tensor: torch.Tensor | None = None
        self.weight: Weight | None = None

    def expect(self, settings: Settings, door: Door) -> Expect:
        if self.media != "application/octet-stream":
            raise UnsupportedMediaTypeError(
                f"Content-Type: expected application/octet-stream, got {self.media or 'none'}"
            )
        wire.check_weight_name("name", self.name)
        self.caller = door.caller
        weights_of(self.state).check_room(self.caller, self.name)  # before a byte is read
        return Expect(settings.max_weight_bytes)

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> None:
        assert isinstance(body, SharedBuffer)
        n = record.bytes_in
        tensors, meta = wire.decode(body.tensor(0, (n,), torch.uint8), WEIGHT_TENSORS)
        if meta:
            given = str(sorted(meta))[:80]
            raise InvalidInputError("__metadata__", "none (a weight takes no options)", given)
        w = tensors.get("w_kv_b")
        if w is None:
            raise InvalidInputError("w_kv_b", "a tensor of that name in the file", "none")
        if w.dim() != 2 or w.dtype not in _DTYPES or min(w.shape) < 1:
            raise InvalidInputError(
                "w_kv_b",
                "[H * (qk_nope_dim + v_head_dim), kv_lora_rank], bfloat16, float16 or float32 "
                "(kv_b_proj's weight, out x in)",
                f"{list(w.shape)} {str(w.dtype).removeprefix('torch.')}",
            )
        self.body, self.tensor = body, w
        return None

    def keep(self, held: Held) -> None:
        assert self.body is not None and self.tensor is not None
        weights = weights_of(self.state)
        assert held.ticket is not None
        # others may have registered meanwhile
        weights.check_room(self.caller, self.name, held.ticket.charged)
        charge = held.hand_out(self.body, "weight")
        self.weight = Weight(self.name, self.caller, self.tensor, self.body, charge)
        weights.register(self.weight)

    async def answer(self, result: Computed | None, record: RequestRecord) -> Response:
        assert self.weight is not None
        return JSONResponse(self.weight.entry())

    def refuse(self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]) -> Response:
        return problem(exc, None, headers)

    def hung_up(self) -> Response:
        return Response(status_code=499)
