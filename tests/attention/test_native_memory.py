"""What the native kernel keeps and allocates: requests of many distinct head counts and head dims
leave a worker's memory bounded, a call's peak stays within `NativeKernel.workspace_bytes`, and
heads packed a group at a time give the same answer as all at once. The memory is measured in a
fresh process (`tests/attention/native_memory.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.attention.native_memory import PEAK_CASES
from tests.batches import BatchSpec, make_batch
from zen_mla.attention import validate
from zen_mla.attention.kernels import native

#: each test once per path of the kernel this CPU runs (tests/attention/conftest.py)
pytestmark = pytest.mark.usefixtures("native_path")

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20

#: RssAnon growth allowed over the sweep of 1000 distinct (H, Dqk, Dv) on 2 threads: the kernels
#: ATen caches for every brgemm shape the kernel can make (at most 164 a thread, 250
#: with the blocks it takes on AMX, 20-65 KiB each)
#: and the allocator's slack. Measured on a Xeon with AMX: ~30 MiB; 281 MiB when the shapes
#: followed the head count (it grew by ~0.3 MiB a shape, never freed).
SWEEP_GROWTH_BOUND = 64 * MIB
#: beyond `workspace_bytes`, a call's peak may hold the oneDNN kernels its shapes make the first
#: time (each thread its own) and the allocator's rounding
PEAK_SLACK = 4 * MIB


def _measure(*args: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.attention.native_memory", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, float] = json.loads(done.stdout)
    return result


@pytest.mark.native
@pytest.mark.slow
def test_distinct_head_counts_and_dims_leave_memory_bounded():
    """1000 calls, each of another (H, Dqk, Dv) (q's row stride follows H), with query and key
    tails of every size: the brgemm shapes come from a fixed set, so RssAnon grows by a bound
    that does not follow the count; and the answers stay right."""
    got = _measure("shapes", "1000", "8")
    assert got["growth"] < SWEEP_GROWTH_BOUND, f"RssAnon grew {got['growth'] / MIB:.0f} MiB"
    assert got["max_error"] < 2e-2  # bf16 out of values up to ~4 against fp64


@pytest.mark.native
@pytest.mark.slow
@pytest.mark.parametrize("case", PEAK_CASES)
def test_workspace_bytes_bounds_a_calls_peak(case):
    """The resident set's peak rise during one call (out and lse allocated before it) is within
    `workspace_bytes`, and not far below what the call allocates (the bound less the tiles the
    threads kept from the warm-up's call): the bound charges what the call takes. The 400,000
    heads of one key each (3.8 MiB in) packed 844 MiB at once; now each packs its own key."""
    got = _measure("peak", case)
    peak, bound = got["peak_growth"], got["workspace_bytes"]
    assert peak <= bound + PEAK_SLACK, f"peak {peak / MIB:.1f} MiB, bound {bound / MIB:.1f} MiB"
    untiled = got["untiled_bytes"]
    # below a MiB (many_short's plan: ~6 KiB) the heap's free pages hold it: no rise to see
    if untiled >= MIB:
        assert peak >= untiled / 2, f"peak {peak / MIB:.1f} MiB, untiled {untiled / MIB:.1f} MiB"


def test_workspace_bytes_of_a_padded_batch_stays_near_the_packing_floor():
    """The hostile batch's bound is at most one group of heads (`PACK_FLOOR_BYTES`) and the
    threads' tiles, far from its 844 MiB of padded keys; MLA's `long` packs all 16 heads at once."""
    q = torch.zeros(1, 400_000, 2, dtype=torch.bfloat16)
    v = torch.zeros(1, 400_000, 1, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1])
    hostile = validate(q, q, v, cu, cu, causal=True, scale=None)
    assert native.NativeKernel.workspace_bytes(
        hostile, return_lse=True, threads=torch.get_num_threads()
    ) < (native.PACK_FLOOR_BYTES + 8 * MIB)
    q = torch.zeros(4096, 16, 192, dtype=torch.bfloat16)
    v = torch.zeros(4096, 16, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4096])
    long = validate(q, q, v, cu, cu, causal=True, scale=None)
    packed = 16 * 4096 * (192 + 128) * 2
    assert (
        packed
        <= native.NativeKernel.workspace_bytes(
            long, return_lse=False, threads=torch.get_num_threads()
        )
        < packed + 8 * MIB
    )


@pytest.mark.native
def test_heads_packed_a_group_at_a_time_give_the_same_answer():
    """A packing budget of one head, of a few, and of all of them: bitwise the same out and lse
    (300 queries: more than one block of them, so that sequence's keys are packed ahead)."""
    q, k, v, q_cu, kv_cu = make_batch(
        BatchSpec([5, 300, 0, 3], [300, 400, 7, 0]), (7, 70, 33), torch.bfloat16, seed=3
    )
    module, _ = native.native_module()
    assert module is not None
    got = []
    for budget in (0, 1, 50_000, 1 << 30):  # 0: no budget
        out = torch.zeros(q.shape[0], 7, 33, dtype=torch.bfloat16)
        lse = torch.zeros(7, q.shape[0])
        torch.ops.zen_mla.native_attend(
            q, k, v, q_cu.long(), kv_cu, 70**-0.5, True, out, lse,
            *native.blocks(), budget, None, native.native_isa(),
        )  # fmt: skip
        got.append((out, lse))
    for out, lse in got[1:]:
        assert torch.equal(out, got[0][0]) and torch.equal(lse, got[0][1])
