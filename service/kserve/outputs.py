"""Where a `/v2` infer request's outputs go (in the response, binary or JSON numbers, or in
system shared memory, written by the workers in place where they can), every range checked,
and the response written."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch
from fastapi.responses import Response

from zen_mla import InvalidInputError
from zen_mla.engine import OutputPlaces, PrefillRequest
from zen_mla.regions import SHM_DIR, CallerShm, Span, SystemRegion, check_disjoint
from zen_mla.wire import tensor_bytes
from zen_mla.wire.dtypes import BY_TORCH

from ..answer import answer_metadata, stream
from ..body import SMALL_BYTES
from ..forms.base import Computed
from . import request as kr

__all__ = ["Places", "direct_outputs", "output_places", "respond", "write_to_region"]

JSON_BYTES_PER_NUMBER = 16  # a generous estimate of one number written as JSON
#: each requested output's region, shape and dtype (None: in the response)
Places = dict[str, tuple[SystemRegion, torch.Size, torch.dtype] | None]


def output_places(
    req: kr.InferRequest,
    prepared: PrefillRequest,
    regions: CallerShm | None,
    max_json_bytes: int,
) -> dict[str, tuple[SystemRegion, torch.Size, torch.dtype] | None]:
    """Each requested output's region (None: in the response), every range checked, and the
    JSON ones within the JSON cap."""
    batch = prepared.batch
    shapes = {
        "out": (torch.Size((batch.q.shape[0], batch.num_heads, batch.v_head_dim)), batch.q.dtype),
        "lse": (torch.Size((batch.num_heads, batch.q.shape[0])), torch.float32),
    }
    places: dict[str, tuple[SystemRegion, torch.Size, torch.dtype] | None] = {}
    spans: list[Span] = []  # at the object's offsets: two regions may share an object
    for name, spec in req.inputs.items():
        if spec.shm is not None and regions is not None:
            region = regions.resolve(name, spec.shm.region)
            start = region.offset + spec.shm.offset
            spans.append(Span(name, region.inode, start, start + spec.nbytes, region.name))
    for out in req.outputs:
        shape, dtype = shapes[out.name]
        nbytes = math.prod(shape) * dtype.itemsize
        if out.shm is None:
            numbers = math.prod(shape)
            if not out.binary and numbers * JSON_BYTES_PER_NUMBER > max_json_bytes:
                raise InvalidInputError(
                    f"{out.name}.binary_data",
                    f"true for an output of {numbers} numbers (as JSON it would pass the "
                    f"{max_json_bytes} byte cap)",
                    "false",
                )
            places[out.name] = None
            continue
        assert regions is not None
        if out.shm.byte_size < nbytes:
            raise InvalidInputError(
                f"{out.name}.shared_memory_byte_size",
                f"at least {nbytes} bytes ({BY_TORCH[dtype].kserve} {list(shape)})",
                str(out.shm.byte_size),
            )
        region = regions.place(out.name, out.shm.region, out.shm.offset, out.shm.byte_size, dtype)
        start = region.offset + out.shm.offset
        spans.append(Span(out.name, region.inode, start, start + nbytes, region.name))
        check_disjoint(spans, (out.name,), f"same {SHM_DIR} object")
        places[out.name] = (region, shape, dtype)
    return places


def direct_outputs(
    req: kr.InferRequest,
    places: dict[str, tuple[SystemRegion, torch.Size, torch.dtype] | None],
) -> OutputPlaces | None:
    """Where the workers write when every output computed goes to one region (no copy): that
    region's buffer and the views; else None (the pool's buffer, then pwrite)."""
    computed = ("out", "lse") if req.return_lse else ("out",)
    chosen = [places.get(n) for n in computed]
    regions = {id(p[0]) for p in chosen if p is not None}
    if None in chosen or len(regions) != 1:
        return None
    views = {}
    for name, place in zip(computed, chosen, strict=True):
        assert place is not None
        region, shape, dtype = place
        spec = next(o for o in req.outputs if o.name == name)
        assert spec.shm is not None
        views[name] = region.view(spec.shm.offset, tuple(shape), dtype)
    first = chosen[0]
    assert first is not None
    return first[0].buffer, views["out"], views.get("lse")


async def respond(
    req: kr.InferRequest,
    result: Computed,
    places: dict[str, tuple[SystemRegion, torch.Size, torch.dtype] | None],
    written: bool,
) -> Response:
    """The response: outputs in regions (written by pwrite unless the workers wrote them),
    binary after the JSON, or as JSON numbers."""
    meta = answer_metadata(result.kernels)  # the request's id is the answer's own `id`
    tensors = {"out": result.out, "lse": result.lse}
    entries, chunks = [], []
    try:
        for out in req.outputs:
            t = tensors[out.name]
            assert t is not None
            entry: dict[str, Any] = {
                "name": out.name,
                "datatype": BY_TORCH[t.dtype].kserve,
                "shape": list(t.shape),
            }
            place = places[out.name]
            if place is not None:
                assert out.shm is not None
                if not written:
                    await write_to_region(place[0], out.shm.offset, t)
                entry["parameters"] = {
                    "shared_memory_region": out.shm.region,
                    "shared_memory_offset": out.shm.offset,
                    "shared_memory_byte_size": t.nbytes,
                }
            elif out.binary:
                data = tensor_bytes(t)
                entry["parameters"] = {"binary_data_size": data.nbytes}
                chunks.append(data)
            else:
                entry["data"] = await asyncio.to_thread(_json_numbers, out.name, t)
            entries.append(entry)
        head = kr.response_header(req, entries, meta)
    except BaseException:
        result.release()
        raise
    if not chunks:  # its numbers are in the JSON: the answer is the head alone, still paced
        return stream(head, [], result, "application/json")
    return stream(
        head,
        chunks,
        result,
        "application/octet-stream",
        {"Inference-Header-Content-Length": str(len(head))},
    )


async def write_to_region(region: SystemRegion, offset: int, t: torch.Tensor) -> None:
    """`t`'s bytes into `region` at `offset` (pwrite; in a thread when large)."""
    data = tensor_bytes(t)
    if data.nbytes > SMALL_BYTES:
        await asyncio.to_thread(region.write, offset, data)
    else:
        region.write(offset, data)


def _json_numbers(name: str, t: torch.Tensor) -> list[Any]:
    """The numbers of `t` for a JSON answer; JSON has no infinities or NaN (the LSE of a query
    that sees no key is -inf), so such an output must be asked for as binary data."""
    flat = t.reshape(-1).float()
    if not bool(torch.isfinite(flat).all()):
        raise InvalidInputError(
            f"{name}.binary_data",
            f"true: {name} holds -inf, inf or NaN (an LSE is -inf where a query sees no key), "
            "which JSON cannot carry",
            "false",
        )
    values: list[Any] = flat.tolist()
    return values
