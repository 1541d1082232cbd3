"""`/prefill` requests whose tensors lie in same-host regions (`zen_mla.wire.regions_json`):
the body names places, the workers read and write the client's memory, and the answer names
where the results are. `routes.prefill` admits, queues and times them as any `/prefill`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from fastapi.responses import Response

from zen_mla import InvalidInputError
from zen_mla.attention import KernelChoice
from zen_mla.engine import PrefillEngine, PrefillRequest
from zen_mla.pool import OutputPlaces, SharedBuffer
from zen_mla.regions.registry import RegionRegistry
from zen_mla.wire import REQUEST_TENSORS, PrefillOptions, parse_options, regions_json
from zen_mla.wire.dtypes import BY_TORCH, safetensors_names

from ..exchange import answer_metadata

__all__ = ["RegionWork", "answer", "answer_body", "resolve"]

_VALUES = safetensors_names("value")
_INDEXES = safetensors_names("index")


@dataclass(frozen=True, slots=True)
class RegionWork:
    """A region request, resolved: what to run, the buffers it reads, where it writes."""

    prepared: PrefillRequest
    inputs: list[SharedBuffer]
    outputs: OutputPlaces
    places: dict[str, regions_json.TensorPlace]
    options: PrefillOptions


@dataclass(frozen=True, slots=True)
class _Placed:
    """What a body resolved to once, and its tensors: all of it holds while its regions stay
    but `work.prepared`, the validation, made again every call (cu_seq_lens live in the
    client's memory)."""

    work: RegionWork
    tensors: dict[str, torch.Tensor]


#: bodies whose resolution is kept (in `RegionRegistry.memo`, emptied whenever a region goes)
RESOLVED_KEPT = 64


def resolve(body: bytes, registry: RegionRegistry, engine: PrefillEngine) -> RegionWork:
    """Every place checked against its region, outputs against the inputs and each other,
    then the batch validated as any other; InvalidInputError names what is wrong.

    An orchestrator sends the same body layer after layer: what a body resolved to is kept
    (~25 us of Python a body) while every region it names stays, and only the validation runs
    again (the batch's offsets are read from the client's memory each call)."""
    key = ("resolved", bytes(body))
    kept = registry.memo.get(key)
    if isinstance(kept, _Placed):
        w = kept.work
        registry.check_populated(w.places)  # holes punched since it was kept
        return RegionWork(
            engine.prepare(kept.tensors, w.options), w.inputs, w.outputs, w.places, w.options
        )
    work, tensors = _resolve(body, registry, engine)
    if len(registry.memo) >= RESOLVED_KEPT:
        registry.memo.clear()
    registry.memo[key] = _Placed(work, tensors)
    return work


def _resolve(
    body: bytes, registry: RegionRegistry, engine: PrefillEngine
) -> tuple[RegionWork, dict[str, torch.Tensor]]:
    message = regions_json.decode(body, regions_json.REQUEST_NAMES)
    options = parse_options(message.metadata)
    places = message.places
    tensors = {
        name: registry.tensor(name, place, _INDEXES if name.endswith("seq_lens") else _VALUES)
        for name, place in places.items()
        if name in REQUEST_TENSORS
    }
    prepared = engine.prepare(tensors, options)
    batch = prepared.batch
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "out": ((batch.q.shape[0], batch.num_heads, batch.v_head_dim), batch.v.dtype)
    }
    if options.return_lse:
        wanted["lse"] = ((batch.num_heads, batch.q.shape[0]), torch.float32)
    extra = sorted(set(places) - set(REQUEST_TENSORS) - set(wanted))
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
    inputs = [registry.resolve(places[n].region).buffer for n in ("q", "k", "v")]
    outputs = (out_region.buffer, views["out"], views.get("lse"))
    return RegionWork(prepared, inputs, outputs, places, options), tensors


def answer_body(work: RegionWork, kernels: KernelChoice, request_id: str | None) -> bytes:
    """Where the results were written, and what computed them (a regions JSON; the same
    answer layer after layer: the last `RESOLVED_KEPT` made are kept)."""
    written = tuple((n, p) for n, p in work.places.items() if n in ("out", "lse"))
    return _answer_body(written, kernels, request_id)


@functools.lru_cache(maxsize=RESOLVED_KEPT)
def _answer_body(
    written: tuple[tuple[str, regions_json.TensorPlace], ...],
    kernels: KernelChoice,
    request_id: str | None,
) -> bytes:
    return regions_json.encode(dict(written), answer_metadata(kernels, request_id))


def answer(work: RegionWork, kernels: KernelChoice, request_id: str | None) -> Response:
    """`answer_body` as an HTTP answer."""
    return Response(answer_body(work, kernels, request_id), media_type=regions_json.MEDIA_TYPE)
