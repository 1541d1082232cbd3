"""A caller with CUDA tensors, as a GPU node's orchestrator calls the service: inputs on the
device (their cu_seq_lens too, as vLLM keeps them), results back on it, `out=` on the device
honoured where it lies and however it is strided, the LSE on the device, and the same on a
client that has no shared memory (the safetensors body). Every answer is checked against
in-process `ragged_attention` on the same CPU tensors (the same kernel, so the same bits) and
against the fp64 reference.

Runs wherever torch sees a CUDA device; skipped, with the reason, everywhere else.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import zen_mla
from tests.batches import BATCH_SPECS, make_batch
from tests.reference import assert_close_to_reference
from zen_mla.client import AsyncPrefillClient, PrefillClient

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: torch.cuda.is_available() is False on this host",
)

DEVICE = torch.device("cuda")
SHAPE = (4, 192, 128)  # H, Dqk, Dv
PATHS = {"regions": True, "safetensors": False}


def _batch(name: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    spec = BATCH_SPECS[name]
    return make_batch(spec, SHAPE, torch.bfloat16), spec.kv_lens is None


def _on_device(args: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if t is None else t.to(DEVICE) for t in args)


def _there(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == DEVICE.type for t in tensors)


@pytest.mark.parametrize("shared_memory", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("name", ["ragged", "prefix_cached"])
def test_inputs_on_the_device_come_back_on_it_as_in_process(server, name, shared_memory):
    args, causal = _batch(name)
    want_out, want_lse = zen_mla.ragged_attention(*args, causal=causal, return_lse=True)
    with PrefillClient(server.url, shared_memory=shared_memory) as client:
        out, lse = client.prefill(*_on_device(args), causal=causal, return_lse=True)
        plain = client.prefill(*_on_device(args), causal=causal)
    assert _there(out, lse, plain)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert torch.equal(out.cpu(), want_out) and torch.equal(plain.cpu(), want_out)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=0, atol=1e-5)
    assert_close_to_reference(*args, causal, out.cpu(), lse.cpu())


@pytest.mark.parametrize("shared_memory", PATHS.values(), ids=PATHS.keys())
def test_out_on_the_device_is_written_where_it_lies(server, shared_memory):
    args, causal = _batch("ragged")
    want = zen_mla.ragged_attention(*args, causal=causal)
    out = torch.full(tuple(want.shape), float("nan"), dtype=want.dtype, device=DEVICE)
    with PrefillClient(server.url, shared_memory=shared_memory) as client:
        got = client.prefill(*_on_device(args), causal=causal, out=out)
    assert got is out
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("shared_memory", PATHS.values(), ids=PATHS.keys())
def test_a_strided_out_on_the_device_is_written_and_nothing_beside_it(server, shared_memory):
    """`out` a view of a wider device tensor (every row strided past its Dv), as a caller's
    slice of a larger output buffer: the view written, the columns beside it untouched."""
    args, causal = _batch("prefix_cached")
    want, want_lse = zen_mla.ragged_attention(*args, causal=causal, return_lse=True)
    tq, h, dv = want.shape
    wide = torch.full((tq, h, dv + 8), 7.0, dtype=want.dtype, device=DEVICE)
    out = wide[:, :, 4 : 4 + dv]
    assert not out.is_contiguous()
    with PrefillClient(server.url, shared_memory=shared_memory) as client:
        got, lse = client.prefill(*_on_device(args), causal=causal, return_lse=True, out=out)
    assert got is out and _there(lse)
    assert torch.equal(out.cpu(), want)
    assert bool((wide[:, :, :4] == 7.0).all()) and bool((wide[:, :, 4 + dv :] == 7.0).all())
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=0, atol=1e-5)


def test_device_inputs_with_cpu_cu_seq_lens_and_a_cpu_out(server):
    """q/k/v on the device, cu_seq_lens and `out` on the CPU: each tensor is taken from where it
    lies, and the result is the caller's CPU `out`."""
    (q, k, v, q_cu, kv_cu), causal = _batch("ragged")
    want = zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, causal=causal)
    out = torch.empty_like(want)
    with PrefillClient(server.url, shared_memory=True) as client:
        q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
        got = client.prefill(q, k, v, q_cu, kv_cu, causal=causal, out=out)
    assert got is out and torch.equal(out, want)


def test_the_async_client_with_device_tensors(server):
    args, causal = _batch("ragged")
    want, want_lse = zen_mla.ragged_attention(*args, causal=causal, return_lse=True)
    out = torch.empty(tuple(want.shape), dtype=want.dtype, device=DEVICE)

    async def main() -> tuple[torch.Tensor, torch.Tensor]:
        async with AsyncPrefillClient(server.url, shared_memory=True) as client:
            got = await client.prefill(*_on_device(args), causal=causal, return_lse=True, out=out)
            assert isinstance(got, tuple)
            return got

    got, lse = asyncio.run(main())
    assert got is out and _there(lse)
    assert torch.equal(out.cpu(), want)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=0, atol=1e-5)
