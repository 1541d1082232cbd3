"""What a regions body resolved to is kept (`forms.regions.RegionsRequest`): the same tensors
for the same body while its regions stay, the batch validated again every call (its offsets live
in the client's memory), and nothing kept once a region goes, or when a body fails."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import zen_mla
from service.forms import regions as routes
from zen_mla.engine import EngineConfig, OutputPlaces, PrefillEngine, PrefillRequest
from zen_mla.pool import PoolConfig
from zen_mla.regions.memfd import create_sealed_memfd
from zen_mla.regions.registry import Region, RegionRegistry
from zen_mla.wire import regions_json
from zen_mla.wire.regions_json import TensorPlace


@dataclass
class Resolution:
    prepared: PrefillRequest
    outputs: OutputPlaces
    places: dict[str, TensorPlace]


def resolve(body: bytes, registry: RegionRegistry, engine: PrefillEngine) -> Resolution:
    """What the pipeline does with a regions body between reading it and running it: read
    (kept, or resolved), validated, outputs placed (and then kept)."""
    form = routes.RegionsRequest(registry)
    resolved = form.resolve(body)
    prepared = engine.prepare(resolved.tensors, resolved.options)
    return Resolution(prepared, form.places(prepared), resolved.places)


@pytest.fixture(scope="module")
def engine():
    return PrefillEngine(EngineConfig(PoolConfig(workers=1)))  # prepare() only: never started


def _setup(engine: PrefillEngine) -> tuple[RegionRegistry, dict[str, Region], Region, bytes]:
    registry = RegionRegistry(max_regions=8, max_bytes=1 << 30, adopt=engine.adopt)
    held: dict[str, Region] = {}
    region = registry.register(create_sealed_memfd(1 << 16), held)
    h = region.handle
    places = {
        "q": TensorPlace(h, 0, "BF16", (5, 2, 16)),
        "k": TensorPlace(h, 1024, "BF16", (5, 2, 16)),
        "v": TensorPlace(h, 2048, "BF16", (5, 2, 8)),
        "q_cu_seq_lens": TensorPlace(h, 3072, "I32", (3,)),
        "out": TensorPlace(h, 4096, "BF16", (5, 2, 8)),
    }
    cu = registry.tensor("q_cu_seq_lens", places["q_cu_seq_lens"], ("I32",))
    cu.copy_(torch.tensor([0, 2, 5], dtype=torch.int32))
    return registry, held, region, regions_json.encode(places, {"causal": "true"})


def test_the_same_body_resolves_to_the_same_tensors_and_is_validated_again(engine):
    registry, _held, region, body = _setup(engine)
    first = resolve(body, registry, engine)
    again = resolve(body, registry, engine)
    assert again.prepared.batch.q is first.prepared.batch.q  # kept, not resolved again
    assert again.prepared is not first.prepared
    assert again.outputs == first.outputs and again.places == first.places
    cu = region.buffer.tensor(3072, (3,), torch.int32)
    cu.copy_(torch.tensor([0, 4, 5], dtype=torch.int32))  # the client moved its offsets
    assert resolve(body, registry, engine).prepared.batch.q_cu_seq_lens == (0, 4, 5)
    cu.copy_(torch.tensor([0, 6, 5], dtype=torch.int32))  # and broke them
    with pytest.raises(zen_mla.InvalidInputError) as info:
        resolve(body, registry, engine)
    assert info.value.name == "q_cu_seq_lens"


@pytest.mark.parametrize("how", ["unregister", "drop"])
def test_nothing_is_kept_once_a_region_goes(engine, how):
    registry, held, region, body = _setup(engine)
    resolve(body, registry, engine)
    assert registry.memo
    if how == "unregister":
        registry.unregister(region.handle, held)
    else:
        registry.drop(held)  # the client's connection ended
    assert not registry.memo
    with pytest.raises(zen_mla.InvalidInputError, match="registered region handle"):
        resolve(body, registry, engine)


def test_a_body_that_fails_is_never_kept_and_the_kept_are_bounded(engine):
    registry, _held, _region, body = _setup(engine)
    bad = body.replace(b'"offset":4096', b'"offset":4097')  # out misaligned for bf16
    for _ in range(2):
        with pytest.raises(zen_mla.InvalidInputError, match=r"out\.offset"):
            resolve(bad, registry, engine)
    assert not registry.memo
    for i in range(routes.RESOLVED_KEPT + 3):
        meta = regions_json.encode(regions_json.decode(body, regions_json.REQUEST_NAMES).places,
                                   {"causal": "true", "request_id": f"r{i}"})  # fmt: skip
        resolve(meta, registry, engine)
    assert 0 < len(registry.memo) <= routes.RESOLVED_KEPT


def test_a_kept_answer_is_the_answer_made_afresh(engine):
    registry, _held, _region, body = _setup(engine)
    work = resolve(body, registry, engine)
    for kernels, request_id in [
        (zen_mla.KernelChoice("zentorch", None), None),
        (zen_mla.KernelChoice("torch", "torch"), None),
        (zen_mla.KernelChoice("zentorch", None), "layer-7"),
    ]:
        got = routes.answer_body(work.places, kernels, request_id)
        assert routes.answer_body(work.places, kernels, request_id) is got  # kept
        answer = regions_json.decode(got, regions_json.RESPONSE_TENSORS)
        assert answer.places == {"out": work.places["out"]}
        assert answer.metadata["kernel"] == kernels.out
        assert answer.metadata.get("lse_kernel") == kernels.lse
        assert answer.metadata.get("request_id") == request_id
