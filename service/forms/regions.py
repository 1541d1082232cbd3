"""`/prefill` requests whose tensors lie in same-host regions (`zen_mla.wire.regions_json`):
the body names places, the workers read and write the client's memory, and the answer names
where the results are. `RegionsRequest` reads such a body (over HTTP or in a region-socket
frame, `forms.call`); `RegionsForm` answers it over HTTP. The pipeline (`pipeline.serve`)
admits, queues and times them as any request.

A body naming `kv_c` and `k_pe` in place of `k` and `v` is a request over MLA's latent cache, as
in a safetensors body: its `__metadata__.weight` names one of its caller's registered weights,
leased for each call (never kept with what the body resolved to)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from fastapi.responses import Response

from zen_mla import InvalidInputError, ZenMLAError, wire
from zen_mla.attention import KernelChoice
from zen_mla.caller import Caller
from zen_mla.engine import OutputPlaces, PrefillEngine, PrefillRequest, SharedBuffer
from zen_mla.regions import RegionRegistry
from zen_mla.wire import (
    LATENT_TENSORS,
    REQUEST_TENSORS,
    PrefillOptions,
    parse_options,
    regions_json,
)
from zen_mla.wire.dtypes import BY_TORCH, safetensors_names

from ..answer import answer_metadata, server_timing
from ..doors import Door
from ..problems import problem
from ..settings import Settings
from ..state import ServiceState
from .base import Computed, Expect, Form, RequestRecord, Work
from .weight import latent_lease

__all__ = ["RESOLVED_KEPT", "RegionsForm", "RegionsRequest", "Resolved", "answer_body"]

_INPUTS = REQUEST_TENSORS | LATENT_TENSORS
_VALUES = safetensors_names("value")
_INDEXES = safetensors_names("index")

#: bodies whose resolution is kept (in `RegionRegistry.memo`, emptied whenever a region goes)
RESOLVED_KEPT = 64


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a body resolved to: its tensors (views of the client's regions), its options, the
    places it names, the buffers its inputs lie in, and where out (and lse) are written. All of
    it holds while its regions stay; only the validation runs again each call (cu_seq_lens live
    in the client's memory)."""

    tensors: dict[str, torch.Tensor]
    options: PrefillOptions
    places: dict[str, regions_json.TensorPlace]
    inputs: list[SharedBuffer]
    outputs: OutputPlaces | None  # None until the body has been validated once


class RegionsRequest:
    """How a regions JSON body is read (`expect`, `decode`) and where its outputs go
    (`places`): every place checked against its region, outputs against the inputs and each
    other.

    An orchestrator sends the same body layer after layer: what a body resolved to is kept
    (~25 us of Python a body, in `RegionRegistry.memo`) while every region it names stays, and
    only the validation runs again (the batch's offsets are read from the client's memory each
    call). A body is kept once it validated. `state`: where the weights a latent body names are
    (None: a reader that only resolves bodies)."""

    def __init__(self, registry: RegionRegistry | None, state: ServiceState | None = None) -> None:
        self._registry = registry
        self.state = state
        self.caller: Caller | None = None
        self.resolved: Resolved | None = None
        self._key: tuple[str, bytes] = ("resolved", b"")

    @property
    def registry(self) -> RegionRegistry:
        # None only while the service starts or stops: the gate answers 503 before a read
        assert self._registry is not None, "regions are served once the engine runs"
        return self._registry

    def expect(self, settings: Settings, door: Door) -> Expect:
        self.caller = door.caller
        return Expect(wire.MAX_HEADER_BYTES, small=True)

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> Work:
        assert isinstance(body, bytes) and self.state is not None
        resolved = self.resolve(body)
        record.request_id = resolved.options.request_id
        tensors = dict(resolved.tensors)  # a weight lent to this call joins this call's alone
        weight, leases = latent_lease(self.state, self.caller, resolved.options, tensors)
        inputs = [*resolved.inputs, *weight]
        return Work(tensors, resolved.options, inputs=inputs, leases=leases)

    def resolve(self, body: bytes) -> Resolved:
        """The body's tensors and places (kept, or resolved now; outputs not placed yet)."""
        registry = self.registry
        self._key = ("resolved", bytes(body))
        kept = registry.memo.get(self._key)
        if isinstance(kept, Resolved):
            registry.check_usable(kept.places)  # holes punched or a write seal added since kept
            self.resolved = kept
            return kept
        message = regions_json.decode(body, regions_json.REQUEST_NAMES)
        options = parse_options(message.metadata, latent=True)
        places = message.places
        tensors = {
            name: registry.tensor(name, place, _INDEXES if name.endswith("seq_lens") else _VALUES)
            for name, place in places.items()
            if name in _INPUTS
        }
        # a tensor not named is left to the validation, which names it
        values = ("q", "k", "v", "kv_c", "k_pe")
        inputs = [registry.resolve(places[n].region).buffer for n in values if n in places]
        self.resolved = Resolved(tensors, options, places, inputs, None)
        return self.resolved

    def places(self, prepared: PrefillRequest) -> OutputPlaces:
        resolved = self.resolved
        assert resolved is not None, "read first"
        if resolved.outputs is not None:
            return resolved.outputs
        outputs = self._place_outputs(resolved, prepared)
        registry = self.registry
        if len(registry.memo) >= RESOLVED_KEPT:
            registry.memo.clear()
        self.resolved = registry.memo[self._key] = Resolved(
            resolved.tensors, resolved.options, resolved.places, resolved.inputs, outputs
        )
        return outputs

    def _place_outputs(self, resolved: Resolved, prepared: PrefillRequest) -> OutputPlaces:
        registry, places = self.registry, resolved.places
        batch = prepared.batch
        wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "out": ((batch.q.shape[0], batch.num_heads, batch.v_head_dim), batch.q.dtype)
        }
        if resolved.options.return_lse:
            wanted["lse"] = ((batch.num_heads, batch.q.shape[0]), torch.float32)
        extra = sorted(set(places) - _INPUTS - set(wanted))
        if extra:
            raise InvalidInputError(
                extra[0], "no place for it (lse is written only with return_lse)", "one"
            )
        views = {}
        for name, (shape, dtype) in wanted.items():
            place = places.get(name)
            if place is None:
                raise InvalidInputError(name, "a place for it in a region", "none")
            if place.shape != shape or place.dtype != BY_TORCH[dtype].safetensors:
                raise InvalidInputError(
                    name,
                    f"{BY_TORCH[dtype].safetensors} {list(shape)}",
                    f"{place.dtype} {list(place.shape)}",
                )
            views[name] = registry.tensor(name, place, (BY_TORCH[dtype].safetensors,))
        registry.check_disjoint(places, tuple(wanted))
        out_region = registry.resolve(places["out"].region)
        if "lse" in places and places["lse"].region != places["out"].region:
            raise InvalidInputError("lse", "a place in out's region", "another region")
        return out_region.buffer, views["out"], views.get("lse")

    def answer_body(self, kernels: KernelChoice, request_id: str | None) -> bytes:
        assert self.resolved is not None
        return answer_body(self.resolved.places, kernels, request_id)


def answer_body(
    places: dict[str, regions_json.TensorPlace], kernels: KernelChoice, request_id: str | None
) -> bytes:
    """Where the results were written, and what computed them (a regions JSON; the same
    answer layer after layer: the last `RESOLVED_KEPT` made are kept)."""
    written = tuple((n, p) for n, p in places.items() if n in ("out", "lse"))
    return _answer_body(written, kernels, request_id)


@functools.lru_cache(maxsize=RESOLVED_KEPT)
def _answer_body(
    written: tuple[tuple[str, regions_json.TensorPlace], ...],
    kernels: KernelChoice,
    request_id: str | None,
) -> bytes:
    return regions_json.encode(dict(written), answer_metadata(kernels, request_id))


class RegionsForm(RegionsRequest, Form[Response]):
    """A regions JSON `/prefill` over HTTP: the answer a regions JSON naming where the results
    were written."""

    route = "prefill"

    async def answer(self, result: Computed | None, record: RequestRecord) -> Response:
        assert result is not None
        body = self.answer_body(result.kernels, record.request_id)
        record.bytes_out = len(body)
        return server_timing(Response(body, media_type=regions_json.MEDIA_TYPE), record)

    def refuse(self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]) -> Response:
        return problem(exc, record.request_id, headers)

    def hung_up(self) -> Response:
        return Response(status_code=499)
