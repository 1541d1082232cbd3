"""`PUT /weights/{name}` (`WeightForm`): a layer's `kv_b_proj` weight, a safetensors file of one
tensor `w_kv_b`, read by the one body reader into the pool's shared memory like any body and
kept there as the caller's registered weight (`service.weights`): its buffer and its bytes'
charge leave the request in one step (`Held.hand_out`). Nothing is computed.

A same-host client may name the weight where it lies in one of its regions instead (a regions
JSON body `{"w_kv_b": place}`, over HTTP or on the region socket, `forms.call`): it is copied
into the pool's shared memory, charged to the caller before the copy is made, and kept so; the
client's region stays the client's to change or let go."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from fastapi import Response
from fastapi.responses import JSONResponse

from zen_mla import (
    BodyTooLargeError,
    InvalidInputError,
    UnsupportedMediaTypeError,
    ZenMLAError,
    wire,
)
from zen_mla.caller import Caller
from zen_mla.engine import PrefillEngine, SharedBuffer
from zen_mla.wire import PrefillOptions, regions_json
from zen_mla.wire.dtypes import BY_TORCH

from ..doors import Door
from ..held import Held
from ..problems import problem
from ..settings import Settings
from ..state import ServiceState, readiness
from ..weights import Weight, Weights
from .base import Computed, Expect, Form, RequestRecord

__all__ = [
    "WEIGHT_TENSORS",
    "WeightForm",
    "WeightRequest",
    "latent_lease",
    "lend_weight",
    "weights_of",
]

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


def latent_lease(
    state: ServiceState,
    caller: Caller | None,
    options: PrefillOptions,
    tensors: dict[str, torch.Tensor],
) -> tuple[list[SharedBuffer], tuple[Callable[[], None], ...]]:
    """A `/prefill` request's weight, in either body form: over the latent cache (`kv_c` among
    `tensors`) the one `__metadata__.weight` names, leased for the work and added to `tensors`
    as `w_kv_b`, with the buffer it lies in; nothing for a request over k and v. A weight named
    without kv_c, or kv_c without a weight, is refused naming `__metadata__.weight`."""
    where = "__metadata__.weight"
    if "kv_c" not in tensors:
        if options.weight is not None:
            raise InvalidInputError(
                where, "none without kv_c (a request over the latent cache)", repr(options.weight)
            )
        return [], ()
    if options.weight is None:
        raise InvalidInputError(
            where, "the name of a registered w_kv_b beside kv_c (PUT /weights/{name})", "none"
        )
    weight, lease = lend_weight(state, caller, options.weight, where, tensors)
    return [weight], (lease,)


class WeightRequest:
    """A weight registration as read, in either body form: one tensor `w_kv_b`
    `[H * (Dn + Dv), R]`, kept in the buffer its safetensors body was read into, or copied there
    from the caller's region; `weight` once registered."""

    route = "weights"
    computes = False

    def __init__(self, state: ServiceState, media: str, name: str) -> None:
        self.state = state
        self.media = media
        self.name = name
        self.caller: Caller | None = None
        self.body: SharedBuffer | None = None
        self.tensor: torch.Tensor | None = None
        self.source: torch.Tensor | None = None  # in the caller's region: copied as it is kept
        self.weight: Weight | None = None
        self.connection: int | None = None  # a region-socket connection it ends with

    def expect(self, settings: Settings, door: Door) -> Expect:
        regions = self.state.regions is not None
        if self.media == regions_json.MEDIA_TYPE and regions:
            expect = Expect(wire.MAX_HEADER_BYTES, small=True)
        elif self.media == "application/octet-stream":
            expect = Expect(settings.max_weight_bytes)
        else:
            offered = "application/octet-stream" + (
                f" or {regions_json.MEDIA_TYPE}" if regions else ""
            )
            raise UnsupportedMediaTypeError(
                f"Content-Type: expected {offered}, got {self.media or 'none'}"
            )
        wire.check_weight_name("name", self.name)
        self.caller = door.caller
        weights_of(self.state).check_room(self.caller, self.name)  # before a byte is read
        return expect

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> None:
        if isinstance(body, bytes):
            self.source = self._placed(body)
            return None
        n = record.bytes_in
        tensors, meta = wire.decode(body.tensor(0, (n,), torch.uint8), WEIGHT_TENSORS)
        if meta:
            given = str(sorted(meta))[:80]
            raise InvalidInputError("__metadata__", "none (a weight takes no options)", given)
        w = tensors.get("w_kv_b")
        if w is None:
            raise InvalidInputError("w_kv_b", "a tensor of that name in the file", "none")
        _check(w)
        self.body, self.tensor = body, w
        return None

    def _placed(self, body: bytes) -> torch.Tensor:
        """The weight where a regions JSON body says it lies, checked against its region."""
        registry = self.state.regions
        assert registry is not None, "a regions body is expected only where regions are"
        message = regions_json.decode(body, WEIGHT_TENSORS)
        if message.metadata:
            given = str(sorted(message.metadata))[:80]
            raise InvalidInputError("__metadata__", "none (a weight takes no options)", given)
        place = message.places.get("w_kv_b")
        if place is None:
            raise InvalidInputError("w_kv_b", "a place for it in a region", "none")
        limit = self.state.settings.max_weight_bytes
        if place.nbytes > limit:
            raise BodyTooLargeError(
                f"w_kv_b: expected at most {limit} bytes (--max-weight-bytes), got {place.nbytes}"
            )
        dtypes = tuple(BY_TORCH[d].safetensors for d in _DTYPES)
        w = registry.tensor("w_kv_b", place, dtypes)
        _check(w)
        return w

    def keep(self, held: Held) -> None:
        weights = weights_of(self.state)
        ticket = held.ticket
        assert ticket is not None
        source = self.source
        n = 0 if source is None else source.nbytes
        # others may have registered meanwhile
        weights.check_room(self.caller, self.name, ticket.charged + n)
        if source is not None:  # charged to the caller before the copy is made
            ticket.charge(n)
            self.body = held.buffer(n)
            self.tensor = self.body.tensor(0, tuple(source.shape), source.dtype)
            self.tensor.copy_(source)
        assert self.body is not None and self.tensor is not None
        charge = held.hand_out(self.body, "weight")
        self.weight = Weight(
            self.name, self.caller, self.tensor, self.body, charge, connection=self.connection
        )
        weights.register(self.weight)


def _check(w: torch.Tensor) -> None:
    if w.dim() != 2 or w.dtype not in _DTYPES or min(w.shape) < 1:
        raise InvalidInputError(
            "w_kv_b",
            "[H * (qk_nope_dim + v_head_dim), kv_lora_rank], bfloat16, float16 or float32 "
            "(kv_b_proj's weight, out x in)",
            f"{list(w.shape)} {str(w.dtype).removeprefix('torch.')}",
        )


class WeightForm(WeightRequest, Form[Response]):
    """A weight registration over HTTP: the answer its name, shape, dtype and bytes."""

    async def answer(self, result: Computed | None, record: RequestRecord) -> Response:
        assert self.weight is not None
        return JSONResponse(self.weight.entry())

    def refuse(self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]) -> Response:
        return problem(exc, None, headers)

    def hung_up(self) -> Response:
        return Response(status_code=499)
