"""Small CPU copies made on the calling thread (`zen_mla.copying`): the same bytes as
`Tensor.copy_` whatever the strides, and `copy_` itself for what the thread does not take."""

from __future__ import annotations

import pytest
import torch

from zen_mla import copying
from zen_mla.copying import SMALL_COPY_BYTES, copied, copy_into


def _sources() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(64, 4, 256, generator=g).bfloat16()
    return {
        "contiguous bf16": torch.randn(64, 4, 192, generator=g).bfloat16(),
        "split view (vLLM's v)": kv[..., 128:],
        "transposed fp32": torch.randn(4, 64, generator=g).t(),
        "expanded (zero stride)": torch.randn(64, 1, 64, generator=g).half().expand(64, 4, 64),
        "int32 offsets": torch.tensor([0, 3, 9, 64], dtype=torch.int32),
        "int64 offsets": torch.tensor([0, 5, 64], dtype=torch.int64),
        "bool": torch.rand(33, generator=g) > 0.5,
        "empty": torch.empty(0, 4, 128, dtype=torch.bfloat16),
        "inference tensor": _inference(kv),
        "requires grad": torch.randn(8, 8, generator=g, requires_grad=True),
    }


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t * 2


@pytest.mark.parametrize("name", list(_sources()))
def test_copy_into_matches_copy_(name: str) -> None:
    src = _sources()[name]
    want = torch.empty(src.shape, dtype=src.dtype).copy_(src.detach())
    dst = torch.full(src.shape, 7, dtype=src.dtype)
    assert copy_into(dst, src) is dst
    assert torch.equal(dst, want)
    got = copied(src)
    assert got.is_contiguous()
    assert src.numel() == 0 or got.data_ptr() != src.data_ptr()
    assert torch.equal(got, want)


def test_copy_into_a_strided_destination() -> None:
    src = torch.arange(24, dtype=torch.float32).view(4, 6)
    dst_base = torch.zeros(6, 4)
    copy_into(dst_base.t(), src)  # rows of src land in columns of the base
    assert torch.equal(dst_base.t(), src)


class _Spy:
    """Counts `Tensor.copy_` calls (the route through torch's thread team)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = torch.Tensor.copy_

        def spy(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            self.calls += 1
            return real(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "copy_", spy)


def test_small_copies_stay_off_torch_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    src = torch.randn(SMALL_COPY_BYTES // 4)  # exactly the bound
    copy_into(torch.empty_like(src), src)
    assert spy.calls == 0


@pytest.mark.parametrize(
    "dst, src",
    [
        (torch.empty(SMALL_COPY_BYTES // 4 + 1), torch.randn(SMALL_COPY_BYTES // 4 + 1)),
        (torch.empty(16, dtype=torch.float32), torch.randn(16).half()),  # a conversion
        (torch.empty(4, 16), torch.randn(16)),  # a broadcast
        (torch.empty(8, dtype=torch.complex64), torch.randn(8, dtype=torch.complex64).conj()),
    ],
    ids=["over the bound", "other dtype", "broadcast", "conjugate view"],
)
def test_other_copies_go_through_torch(
    monkeypatch: pytest.MonkeyPatch, dst: torch.Tensor, src: torch.Tensor
) -> None:
    want = dst.clone().copy_(src)
    spy = _Spy(monkeypatch)
    copy_into(dst, src)
    assert spy.calls == 1
    assert torch.equal(dst, want)


def test_the_bound_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copying, "SMALL_COPY_BYTES", 0)
    spy = _Spy(monkeypatch)
    src = torch.randn(4)
    copy_into(torch.empty(4), src)
    assert spy.calls == 1
