"""zen-mla's native kernel as the torch operator `torch.ops.zen_mla.native_attend`: registered
once the extension is imported, its schema's mutations true to what it writes (torch's
opcheck), its fake kernel traced without data (FakeTensorMode), and torch.compile(fullgraph)
equal to eager."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from tests.batches import BatchSpec, make_batch
from zen_mla.attention.kernels import native

# skips, with why, where the extension is not built or cannot run; once per path of the kernel
# this CPU runs (tests/attention/conftest.py)
pytestmark = [pytest.mark.native, pytest.mark.usefixtures("native_path")]

#: MLA's head dims at two heads, (H, Dqk, Dv)
HEADS = (2, 192, 128)
#: two sequences: a prefix-cached one (5 queries over 12 keys) and a square one
SPEC = BatchSpec([5, 20], [12, 20])
SCALE = 192**-0.5


def _args(causal: bool, with_lse: bool) -> tuple[object, ...]:
    """The operator's positional arguments over SPEC: q [25, 2, 192], k [32, 2, 192], v
    [32, 2, 128] bf16, the cu_seq_lens [3] int64, scale, causal, out [25, 2, 128] bf16 and lse
    [2, 25] fp32 (or None), this CPU's blocks, no packing budget, no parts and the path the
    test runs on."""
    q, k, v, q_cu, kv_cu = make_batch(SPEC, HEADS, torch.bfloat16, seed=7)
    assert kv_cu is not None
    out = torch.zeros(q.shape[0], HEADS[0], HEADS[2], dtype=torch.bfloat16)
    lse = torch.zeros(HEADS[0], q.shape[0]) if with_lse else None
    return (
        q, k, v, q_cu.long(), kv_cu, SCALE, causal, out, lse, *native.blocks(), 0, None,
        native.native_isa(),
    )  # fmt: skip


@pytest.fixture(scope="module")
def op() -> torch._ops.OpOverloadPacket:
    module, why = native.native_module()
    assert module is not None, why
    return torch.ops.zen_mla.native_attend


def test_the_operator_exists_with_its_writes_declared(op):
    """Importing the extension registers `zen_mla::native_attend`, whose schema marks out, lse
    and parts (and nothing else) as written, and which returns nothing."""
    assert hasattr(torch.ops.zen_mla, "native_attend")
    schema = op.default._schema
    assert schema.name == native.OPERATOR
    written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert written == {"out", "lse", "parts"}
    assert list(schema.returns) == []


@pytest.mark.parametrize("with_lse", [True, False], ids=["lse", "no_lse"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_opcheck(op, causal, with_lse):
    """torch's own checks of a custom operator: the schema against what the kernel mutates,
    the fake kernel against the real one, autograd's registration, and AOT dispatch with
    dynamic shapes."""
    torch.library.opcheck(op.default, _args(causal, with_lse))


def test_fake_tensors_trace_without_data(op):
    """Under FakeTensorMode the operator runs its fake kernel only: nothing is computed, and out
    and lse keep their shapes, dtypes and fakeness."""
    real = _args(True, True)
    mode = FakeTensorMode()
    fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in real)
    with mode:
        assert op(*fake) is None
    out, lse = fake[7], fake[8]
    assert isinstance(out, FakeTensor) and isinstance(lse, FakeTensor)
    assert (out.shape, out.dtype) == ((25, 2, 128), torch.bfloat16)
    assert (lse.shape, lse.dtype) == ((2, 25), torch.float32)
    assert not real[7].any() and not real[8].any()  # the real tensors were never written


def test_meta_tensors_run_the_fake_kernel(op):
    """On the meta device (no data at all) the operator dispatches to its fake kernel."""
    meta = tuple(
        a.to("meta") if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in _args(False, True)
    )
    assert op(*meta) is None


def test_parts_receives_the_time_of_each_part(op):
    """`parts` (float64 [8]): the seconds of each of the kernel's six parts summed over its
    threads, then its wall time and the threads it used (bench/kernel.py reads them)."""
    parts = torch.zeros(8, dtype=torch.float64)
    args = _args(True, True)
    op(*args[:-3], 0, parts, args[-1])
    assert (parts[:6] >= 0).all() and parts[6] > 0
    assert 1 <= parts[7] <= torch.get_num_threads()


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_cu: torch.Tensor,
    kv_cu: torch.Tensor,
    bm: int,
    bn: int,
    isa: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twice out [Tq, H, Dv] bf16, and lse [H, Tq] fp32, through the operator, out and lse
    allocated here: a graph that torch.compile must capture whole."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    torch.ops.zen_mla.native_attend(
        q, k, v, q_cu, kv_cu, SCALE, True, out, lse, bm, bn, 0, None, isa
    )
    return out * 2, lse


def test_compiled_in_one_graph_equals_eager(op):
    """torch.compile(fullgraph=True) with inductor: no graph break at the operator, and the
    same out and lse, bitwise, as the eager call."""
    inputs = (*_args(True, True)[:5], *native.blocks(), native.native_isa())
    want = attend(*inputs)
    got = torch.compile(attend, fullgraph=True, dynamic=False)(*inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
