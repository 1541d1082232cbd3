"""Small CPU copies made on the calling thread (`zen_mla.copying`): the same bytes as
`Tensor.copy_` whatever the strides, and `copy_` itself for what the thread does not take."""

from __future__ import annotations

import pytest
import torch

from zen_mla import copying
from zen_mla.copying import SMALL_COPY_BYTES, TORCH_GRAIN, copied, copy_into

_BIG = TORCH_GRAIN * 2  # elements: over the grain, well within the bound


def _sources() -> dict[str, torch.Tensor]:
    """Tensors over torch's grain (copied on this thread), and two under it (through copy_)."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(128, 16, 256, generator=g).bfloat16()
    return {
        "contiguous bf16": torch.randn(128, 16, 192, generator=g).bfloat16(),
        "split view (vLLM's v)": kv[..., 128:],
        "transposed fp32": torch.randn(64, 1024, generator=g).t(),
        "expanded (zero stride)": torch.randn(128, 1, 64, generator=g).half().expand(128, 16, 64),
        "int32": torch.randint(0, 1 << 30, (40000,), generator=g, dtype=torch.int32),
        "int64": torch.randint(0, 1 << 60, (40000,), generator=g, dtype=torch.int64),
        "bool": torch.rand(40000, generator=g) > 0.5,
        "inference tensor": _inference(kv),
        "requires grad": torch.randn(200, 200, generator=g, requires_grad=True),
        "offsets (under the grain)": torch.tensor([0, 3, 9, 64], dtype=torch.int32),
        "empty": torch.empty(0, 4, 128, dtype=torch.bfloat16),
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


@pytest.mark.parametrize("n", [TORCH_GRAIN + 1, SMALL_COPY_BYTES // 4])  # fp32: 4 bytes each
def test_copies_over_the_grain_and_within_the_bound_stay_off_copy_(
    monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    spy = _Spy(monkeypatch)
    src = torch.randn(n)
    dst = copy_into(torch.empty_like(src), src)
    assert spy.calls == 0
    assert torch.equal(dst, src)


@pytest.mark.parametrize(
    "dst, src",
    [
        (torch.empty(TORCH_GRAIN), torch.randn(TORCH_GRAIN)),
        (torch.empty(SMALL_COPY_BYTES // 4 + 1), torch.randn(SMALL_COPY_BYTES // 4 + 1)),
        (torch.empty(_BIG, dtype=torch.float32), torch.randn(_BIG).half()),  # a conversion
        (torch.empty(4, _BIG), torch.randn(_BIG)),  # a broadcast
        (torch.empty(_BIG, dtype=torch.complex64), torch.randn(_BIG, dtype=torch.complex64).conj()),
    ],
    ids=["at the grain", "over the bound", "other dtype", "broadcast", "conjugate view"],
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
    src = torch.randn(_BIG)
    copy_into(torch.empty(_BIG), src)
    assert spy.calls == 1
