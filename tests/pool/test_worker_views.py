"""The worker's mappings and the views it keeps across tasks (`_worker._Mapped`), on real memfd
buffers mapped as a worker maps them: a kept view is the same tensor call after call, and none
outlives a mapping that changed."""

from __future__ import annotations

import os

import torch

from zen_mla.pool._messages import TensorRef
from zen_mla.pool._shm import SharedBuffer, tensor_ref
from zen_mla.pool._worker import VIEWS_KEPT, _Mapped


def _filled(value: float) -> tuple[SharedBuffer, torch.Tensor]:
    buf = SharedBuffer(1 << 16)
    t = buf.tensor(64, (4, 2, 8), torch.bfloat16).fill_(value)
    return buf, t


def _map(mapped: _Mapped, buf: SharedBuffer, as_id: int | None = None) -> None:
    mapped.map(buf.id if as_id is None else as_id, os.dup(buf.fd), buf.nbytes, populate=True)


def _one_kept(value: float) -> tuple[_Mapped, SharedBuffer, torch.Tensor, TensorRef, torch.Tensor]:
    """A worker's mappings with one buffer filled with `value`, a tensor of it named once: the
    buffer, the tensor, its ref and the view kept for it."""
    mapped = _Mapped()
    buf, t = _filled(value)
    _map(mapped, buf)
    ref = tensor_ref(buf, t)
    return mapped, buf, t, ref, mapped.tensor(ref)


def test_a_view_named_again_is_the_same_tensor_and_reads_the_buffer():
    mapped, _, t, ref, first = _one_kept(1.0)
    assert mapped.tensor(ref) is first
    t.fill_(3.0)  # the buffer is shared: the kept view sees what was written since
    assert torch.equal(mapped.tensor(ref), t)


def test_no_view_outlives_a_mapping_that_changed():
    mapped, old, _, ref, kept = _one_kept(1.0)
    # the buffer is forgotten, and another is sent under the same id (as after a Failed task,
    # or a reused id): the tensor named by the same ref must be the new buffer's
    mapped.forget([old.id])
    new, t_new = _filled(5.0)
    _map(mapped, new, as_id=old.id)
    again = mapped.tensor(ref)
    assert again is not kept
    assert torch.equal(again, t_new)
    # mapping any buffer drops the kept views as well
    other, _ = _filled(0.0)
    _map(mapped, other)
    assert mapped.tensor(ref) is not again


def test_forgetting_a_buffer_not_mapped_keeps_the_views():
    mapped, buf, _, ref, kept = _one_kept(2.0)
    mapped.forget([buf.id + 1000])
    assert mapped.tensor(ref) is kept


def test_the_views_kept_are_bounded():
    mapped = _Mapped()
    buf = SharedBuffer(1 << 16)
    _map(mapped, buf)
    refs = [
        tensor_ref(buf, buf.tensor(64 * i, (2,), torch.bfloat16)) for i in range(VIEWS_KEPT + 1)
    ]
    first = mapped.tensor(refs[0])
    for ref in refs[1:]:
        mapped.tensor(ref)
    assert len(mapped._views) <= VIEWS_KEPT
    assert mapped.tensor(refs[0]) is not first  # dropped with the rest when the cap was hit
