"""Round trips through a real server, against the fp64 test reference."""

from __future__ import annotations

import asyncio

import pytest
import torch

import zen_mla
from tests.batches import BATCH_SPECS, make_batch
from tests.reference import assert_close_to_reference
from zen_mla.attention.calibrate import cache_path
from zen_mla.client import AsyncPrefillClient, PrefillClient

MLA = (4, 192, 128)


def check(q, k, v, q_cu, kv_cu, causal, got, return_lse):
    out, lse = got if return_lse else (got, None)
    assert_close_to_reference(q, k, v, q_cu, kv_cu, causal, out, lse)


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("spec", BATCH_SPECS.values(), ids=BATCH_SPECS.keys())
def test_round_trip(server, spec, return_lse):
    causal = spec.kv_lens is None or spec is BATCH_SPECS["prefix_cached"]
    q, k, v, q_cu, kv_cu = make_batch(spec, MLA, torch.bfloat16)
    with PrefillClient(server.url) as client:
        got = client.prefill(q, k, v, q_cu, kv_cu, causal=causal, return_lse=return_lse)
    check(q, k, v, q_cu, kv_cu, causal, got, return_lse)


def test_same_numbers_as_the_library(server):
    q, k, v, q_cu, _kv_cu = make_batch(BATCH_SPECS["ragged"], MLA, torch.bfloat16)
    with PrefillClient(server.url) as client:
        out, lse = client.prefill(q, k, v, q_cu, return_lse=True, scale=0.1)
    want_out, want_lse = zen_mla.ragged_attention(q, k, v, q_cu, return_lse=True, scale=0.1)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_async_client(server):
    async def main():
        q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS["context_chunk"], MLA, torch.float32)
        async with AsyncPrefillClient(server.url) as client:
            got = await asyncio.gather(
                *(
                    client.prefill(q, k, v, q_cu, kv_cu, causal=False, return_lse=True)
                    for _ in range(3)
                )
            )
            assert (await client.health())["status"] == "ok"
        for g in got:
            check(q, k, v, q_cu, kv_cu, False, g, True)

    asyncio.run(main())


def test_unix_socket(uds_server):
    q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS["prefix_cached"], MLA, torch.bfloat16)
    with PrefillClient(uds_server.url, uds=uds_server.uds) as client:
        got = client.prefill(q, k, v, q_cu, kv_cu)
        assert client.health()["status"] == "ok"
    check(q, k, v, q_cu, kv_cu, True, got, False)


@pytest.mark.slow  # getfixturevalue: the server fixtures are not seen at collection
@pytest.mark.parametrize("where", ["server", "uds_server"])
def test_large_answers_read_from_the_socket(where, request):
    """Answers of 4 MiB (the blocking client reads them past httpx, straight into its answer
    memory), then a small one and /health on the same client: each the library's numbers."""
    served = request.getfixturevalue(where)
    q = torch.randn(1024, 16, 192, dtype=torch.bfloat16)
    k, v = torch.randn(4, 16, 192, dtype=torch.bfloat16), torch.randn(4, 16, 128).bfloat16()
    q_cu, kv_cu = torch.tensor([0, 1024], dtype=torch.int32), torch.tensor([0, 4]).int()
    with PrefillClient(served.url, uds=served.uds, shared_memory=False) as client:
        for return_lse in (False, True, False):
            args = (q, k, v, q_cu, kv_cu)
            got = client.prefill(*args, causal=False, return_lse=return_lse)
            want = zen_mla.ragged_attention(*args, causal=False, return_lse=return_lse)
            got, want = (got, want) if return_lse else ((got,), (want,))
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        small = (q[:2], k, v, torch.tensor([0, 2]).int(), kv_cu)
        got_small = client.prefill(*small, causal=False)
        assert torch.equal(got_small, zen_mla.ragged_attention(*small, causal=False))
        assert client.health()["status"] == "ok"


def test_health_names_the_kernel_auto_takes_and_its_calibration(server):
    """The service's choice is this host's: the same kernels, reasons and calibration figures
    as `host_kernels()` in this process (the calibration is kept on disk per host and build, so
    the service's processes and this one agree); the deprecated keys say the same."""
    with PrefillClient(server.url) as client:
        health = client.health()
    ours = zen_mla.host_kernels()
    if not cache_path().exists():  # each process measured for itself: the winners may differ
        pytest.skip(f"no calibration kept here ({cache_path()} cannot be written)")
    kernels = health["kernels"]
    assert set(kernels) == {"auto", "native", "zentorch", "cpu"}
    assert kernels["zentorch"] == ours["zentorch"] and kernels["native"] == ours["native"]
    for mode in ("out", "lse"):
        theirs, mine = kernels["auto"][mode], ours["auto"][mode]
        assert theirs["kernel"] == mine["kernel"]
        if mine["calibration"] is None:
            assert theirs["calibration"] is None
            continue
        assert theirs["calibration"]["seconds"] == mine["calibration"]["seconds"]
        assert theirs["calibration"]["winner"] == theirs["kernel"]
    # the deprecated keys: the same facts where clients read them before `kernels`
    assert health["zentorch"] == kernels["zentorch"]
    assert health["kernel"] == kernels["auto"]["out"]["kernel"]
    assert health["lse_kernel"] == kernels["auto"]["lse"]["kernel"]
    assert health["kernel_reason"] == kernels["auto"]["out"]["reason"]
    assert health["lse_kernel_reason"] == kernels["auto"]["lse"]["reason"]
    assert health["kernel_calibration"] == {
        mode: kernels["auto"][mode]["calibration"] for mode in ("out", "lse")
    }


def test_response_metadata_and_timing(server):
    from zen_mla import wire

    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["single"], MLA, torch.bfloat16)
    header, chunks = wire.encode(
        {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu},
        {"request_id": "abc-123", "kernel": "torch"},
    )
    body = header + b"".join(bytes(c) for c in chunks)
    with server.client() as c:
        r = c.post("/prefill", content=body, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 200
    timing = r.headers["server-timing"]
    assert "queue;dur=" in timing and "compute;dur=" in timing
    tensors, meta = wire.decode(
        torch.frombuffer(bytearray(r.content), dtype=torch.uint8), wire.RESPONSE_TENSORS
    )
    assert meta == {"kernel": "torch", "request_id": "abc-123"}
    assert set(tensors) == {"out"}


@pytest.mark.zentorch
@pytest.mark.parametrize("spec", ["ragged", "prefix_cached", "equal_runs"])
def test_round_trip_on_zentorch(server, spec):
    """The workers load zentorch and run it when a request names it."""
    q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS[spec], MLA, torch.bfloat16)
    with PrefillClient(server.url) as client:
        got = client.prefill(q, k, v, q_cu, kv_cu, kernel="zentorch")
    check(q, k, v, q_cu, kv_cu, True, got, False)
    assert torch.equal(got, zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, kernel="zentorch"))
