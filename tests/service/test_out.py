"""`prefill(out=)`: the result written into the caller's tensor, through every path a client
takes (region-socket call, regions over HTTP, a safetensors body; sync and async), and an
`out` that cannot hold the result refused before anything is sent."""

from __future__ import annotations

import asyncio

import pytest
import torch

import zen_mla
from tests.batches import BatchSpec, make_batch
from tests.reference import assert_close_to_reference
from tests.service.servers import free_port
from zen_mla.client import AsyncPrefillClient, PrefillClient

H, DQK, DV = 4, 192, 128


def _batch(seed: int = 0):
    """Two requests of 7 and 13 tokens: q, k, v and q's cumulative lengths."""
    q, k, v, q_cu, _ = make_batch(BatchSpec([7, 13]), (H, DQK, DV), torch.bfloat16, seed)
    return q, k, v, q_cu


def _padded_out() -> tuple[torch.Tensor, torch.Tensor]:
    """A strided `out`: the first Dv columns of a wider buffer (as vLLM pads V to Dqk), the
    padding filled with a value no result holds."""
    wide = torch.full((20, H, DQK), 7.0, dtype=torch.bfloat16)
    return wide, wide[..., :DV]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["regions", "tcp"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
def test_sync_out_is_written_in_place_and_returned(server, shared_memory, return_lse):
    q, k, v, cu = _batch()
    wide, out = _padded_out()
    with PrefillClient(server.url, shared_memory=shared_memory) as client:
        regions = client.regions(0)
        assert (regions is not None and regions.connection.calls) is shared_memory  # the call path
        got = client.prefill(q, k, v, cu, return_lse=return_lse, out=out)
        result, lse = got if return_lse else (got, None)
        assert result is out
        assert_close_to_reference(q, k, v, cu, None, True, out, lse)
        assert bool((wide[..., DV:] == 7.0).all())  # nothing written past the view
        if regions is not None:  # and as regions over HTTP (where no calls are offered)
            regions.connection.hello["calls"] = False
            out.fill_(float("nan"))
            assert client.prefill(q, k, v, cu, out=out) is out
            assert_close_to_reference(q, k, v, cu, None, True, out)


@pytest.mark.parametrize("shared_memory", [None, False], ids=["auto", "tcp"])
def test_async_out_is_written_in_place_and_returned(server, shared_memory):
    q, k, v, cu = _batch(1)
    out = torch.full((20, H, DV), float("nan"), dtype=torch.bfloat16)

    async def main():
        async with AsyncPrefillClient(server.url, shared_memory=shared_memory) as client:
            return await client.prefill(q, k, v, cu, return_lse=True, out=out)

    got, lse = asyncio.run(main())
    assert got is out
    assert_close_to_reference(q, k, v, cu, None, True, out, lse)


@pytest.mark.parametrize(
    ("out", "match"),
    [
        (torch.empty(20, H, DQK, dtype=torch.bfloat16), r"out: expected \[20, 4, 128\] bfloat16"),
        (torch.empty(20, H, DV), r"got \[20, 4, 128\] float32"),
        ("a list", "expected a torch.Tensor"),
    ],
    ids=["shape", "dtype", "not_a_tensor"],
)
def test_an_out_that_cannot_hold_the_result_is_refused_before_sending(out, match):
    """Nothing listens at the URL: the refusal comes before any connection is tried."""
    q, k, v, cu = _batch()
    client = PrefillClient(f"http://127.0.0.1:{free_port()}", retries=0)
    with client, pytest.raises(zen_mla.InvalidInputError, match=match) as info:
        client.prefill(q, k, v, cu, out=out)
    assert info.value.name == "out"


def test_an_out_in_the_clients_own_region_is_written_there_by_the_service(server):
    """`out` made by `empty()`: the service is told to write it in place (no copy back); with
    an LSE, or over an input's bytes, it goes through the scratch region and is copied."""
    q, k, v, cu = _batch(2)
    with PrefillClient(server.url, shared_memory=True) as client:
        regions = client.regions(0)
        assert regions is not None
        tensors = {"q": q, "k": k, "v": v, "q_cu_seq_lens": cu}
        out = client.empty((20, H, DV), torch.bfloat16)
        with regions.request(tensors, False, out) as layout:
            assert layout.out is out and layout.places["out"] == regions.where(out)
        with regions.request(tensors, True, out) as layout:  # lse goes in out's region
            assert layout.out is not out
        out.fill_(float("nan"))
        assert client.prefill(q, k, v, cu, out=out) is out
        assert_close_to_reference(q, k, v, cu, None, True, out)
        got, lse = client.prefill(q, k, v, cu, out=out, return_lse=True)
        assert got is out
        assert_close_to_reference(q, k, v, cu, None, True, out, lse)

        # q itself in a region, out over its bytes: named apart, then copied
        qe = client.empty((20, H, DQK), torch.bfloat16)
        qe.copy_(q)
        over = qe.view(-1)[: 20 * H * DV].view(20, H, DV)
        with regions.request(tensors | {"q": qe}, False, over) as layout:
            assert layout.out is not over
        q_kept = qe.clone()
        assert client.prefill(qe, k, v, cu, out=over) is over
        assert_close_to_reference(q_kept, k, v, cu, None, True, over)
