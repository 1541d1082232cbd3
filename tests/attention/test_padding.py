"""V padded for the fused kernels in memory kept between batches (`attention.padding`)."""

from __future__ import annotations

import pytest
import torch

from zen_mla.attention import padding
from zen_mla.attention.padding import padded


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(0, 4, 128), (7, 2, 128), (300, 16, 64)])
def test_padded_is_v_and_zeros_even_in_dirty_memory(dtype, shape):
    with padded(torch.full((512, 16, 192), float("nan"), dtype=dtype), 256):
        pass  # the kept buffer now holds NaNs where the next padding goes
    v = torch.randn(*shape).to(dtype)
    with padded(v, 192) as got:
        assert torch.equal(got, torch.nn.functional.pad(v, (0, 192 - shape[2])))


def test_the_memory_is_kept_for_the_next_batch():
    v = torch.randn(64, 4, 128, dtype=torch.bfloat16)
    with padded(v, 192) as first:
        address = first.data_ptr()
    with padded(v[:32], 192) as second:
        assert second.data_ptr() == address
        with padded(v, 192) as inner:  # while the kept memory is in use: other memory
            assert inner.data_ptr() != address
            assert torch.equal(second[..., :128], v[:32])


def test_a_v_over_the_bound_is_padded_in_fresh_memory(monkeypatch):
    monkeypatch.setattr(padding, "KEEP_BYTES", 1 << 10)
    monkeypatch.setattr(padding, "_kept", padding._KeptBuffer())
    v = torch.randn(64, 4, 128, dtype=torch.bfloat16)
    with padded(v, 192) as got:
        assert torch.equal(got, torch.nn.functional.pad(v, (0, 64)))
    assert padding._kept.buf is None


def test_padded_under_inference_mode_can_require_grad():
    """zentorch's LSE route marks the padded V as requiring grad."""
    with torch.inference_mode():
        v = torch.randn(16, 2, 128)
        with padded(v, 192) as got:
            assert not got.is_inference()
            got.detach().requires_grad_()


def test_a_v_over_the_bound_leaves_the_kept_memory_kept(monkeypatch):
    monkeypatch.setattr(padding, "_kept", padding._KeptBuffer())
    small = torch.randn(8, 4, 128, dtype=torch.bfloat16)
    with padded(small, 192) as got:
        address = got.data_ptr()
    monkeypatch.setattr(padding, "KEEP_BYTES", 64 << 10)
    with padded(torch.randn(512, 4, 128, dtype=torch.bfloat16), 192):
        pass
    with padded(small, 192) as again:
        assert again.data_ptr() == address
