"""What the region client keeps between calls: a call's frame by its places and options, and
a scratch region's views by their slot. Kept means the same bytes or the same view as made
afresh, never a stale one."""

from __future__ import annotations

import json

import torch

from tests.regions.region_sockets import running
from zen_mla.regions import connection as region_connection
from zen_mla.regions.connection import ClientRegion, RegionConnection, prefill_fields
from zen_mla.regions.protocol import encode_frame, numbered
from zen_mla.wire import regions_json
from zen_mla.wire.regions_json import TensorPlace


def _places(offset: int = 0) -> dict[str, TensorPlace]:
    return {
        "q": TensorPlace("r1", offset, "BF16", (4, 2, 8)),
        "out": TensorPlace("r1", offset + 4096, "BF16", (4, 2, 8)),
    }


def test_a_kept_frame_is_the_frame_made_afresh_and_follows_its_inputs():
    options = {"causal": "true", "return_lse": "false"}
    fields = prefill_fields(_places(), options)
    body = regions_json.encode(_places(), options).decode()
    for call in (1, 7, 1 << 40):  # numbered, the frame encode_frame makes of the same fields
        expected = encode_frame({"op": "prefill", "call": call, "body": body})
        assert numbered(call, fields) == expected
    assert prefill_fields(_places(), dict(options)) is fields  # kept: equal inputs, same bytes
    moved = numbered(2, prefill_fields(_places(64), options))
    assert json.loads(json.loads(moved[4:])["body"])["q"]["offset"] == 64
    other = numbered(3, prefill_fields(_places(), options | {"return_lse": "true"}))
    assert json.loads(json.loads(other[4:])["body"])["__metadata__"]["return_lse"] == "true"
    info = region_connection._prefill_fields.cache_info()
    assert info.maxsize == region_connection.FRAMES_KEPT


def test_a_slot_is_one_view_of_its_bytes_until_the_slots_kept_are_spent(tmp_path):
    with running(tmp_path) as r:
        client = RegionConnection(r.server.path, None, timeout=5)
        region = ClientRegion(client, 1 << 20)
        a = region.slot(128, (4, 2, 8), torch.bfloat16)
        assert region.slot(128, (4, 2, 8), torch.bfloat16) is a
        assert a.place == TensorPlace(region.handle, 128, "BF16", (4, 2, 8))
        assert a.view.data_ptr() == region.base + 128 and a.view.shape == (4, 2, 8)
        a.view.fill_(3.0)
        assert torch.equal(region.tensor(128, (4, 2, 8), torch.bfloat16), a.view)
        b = region.slot(128, (8, 8), torch.float32)  # same offset, another tensor
        assert b is not a and b.place.dtype == "F32" and b.view.shape == (8, 8)
        for i in range(region_connection.SLOTS_KEPT):
            region.slot(4096 + 64 * i, (1,), torch.float32)
        assert len(region._slots) <= region_connection.SLOTS_KEPT
        again = region.slot(128, (4, 2, 8), torch.bfloat16)
        assert again.place == a.place and torch.equal(again.view, a.view)
        client.close()
