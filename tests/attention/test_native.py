"""zen-mla's native kernel (`kernels/native.cpp`): against fp64 on the contract's edge cases at
MLA's head dims, across its query and key blocks, against the other kernels, with any thread
count, from many threads at once, and why it is unavailable where it is."""

from __future__ import annotations

import re
import threading

import pytest
import torch

import zen_mla
from tests.attention.kernels_ran import kernels_ran
from tests.batches import BatchSpec, make_batch
from tests.reference import attention_fp64
from zen_mla.attention import probes, validate
from zen_mla.attention.kernels import native

#: each test once per path of the kernel this CPU runs (tests/attention/conftest.py)
pytestmark = pytest.mark.usefixtures("native_path")

MLA = (4, 192, 128)

#: (q lens, kv lens, causal): the edge cases, and shapes that cross the kernel's blocks (64
#: queries, 256 keys: a block's last key, one key past it, tails of one)
CASES = {
    "one_token": ([1], [1], True),
    "one_query_many_keys": ([1], [700], True),
    "empty_and_one": ([0, 1, 0, 3], [0, 1, 5, 3], True),
    "no_keys": ([4, 2], [0, 0], True),
    "more_queries_than_keys": ([100, 7], [30, 0], True),
    "prefix_cached": ([3, 65, 1], [300, 321, 257], True),
    "square_across_blocks": ([257, 64, 65, 129], [257, 64, 65, 129], True),
    "chunk_non_causal": ([70, 5], [513, 256], False),
    "more_queries_non_causal": ([300], [17], False),
}


def _run(spec: BatchSpec, causal: bool, heads=MLA, kernel="native", seed=0):
    q, k, v, q_cu, kv_cu = make_batch(spec, heads, torch.bfloat16, seed=seed)
    out, lse = zen_mla.ragged_attention(
        q, k, v, q_cu, kv_cu, causal=causal, return_lse=True, kernel=kernel
    )
    return (q, k, v, q_cu, kv_cu), out, lse


@pytest.mark.native
@pytest.mark.parametrize("name", CASES)
def test_matches_fp64(name):
    q_lens, kv_lens, causal = CASES[name]
    (q, k, v, q_cu, kv_cu), out, lse = _run(BatchSpec(q_lens, kv_lens), causal)
    want_out, want_lse = attention_fp64(
        q, k, v, q_cu.tolist(), kv_cu.tolist(), causal=causal, scale=192**-0.5
    )
    blind = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), blind), "lse is -inf exactly where no key is seen"
    assert torch.equal(out.permute(1, 0, 2)[blind], torch.zeros_like(out.permute(1, 0, 2)[blind]))
    if (~blind).any():
        assert (lse.double() - want_lse)[~blind].abs().max() < 1e-3
    # bf16 out: within its rounding of values below 1 in size (1/128), and on average far less
    err = (out.double() - want_out).abs()
    assert err.max() < 1e-2 and err.mean() < 1e-3


@pytest.mark.native
def test_runs_only_the_native_kernel_with_the_model_head_dims():
    q, k, v, q_cu, kv_cu = make_batch(BatchSpec([64, 300], [64, 300]), MLA, torch.bfloat16)
    _, ran = kernels_ran(lambda: zen_mla.ragged_attention(q, k, v, q_cu, kv_cu, kernel="native"))
    assert ran == {"native"}


@pytest.mark.native
@pytest.mark.parametrize(
    "heads",
    [(2, 64, 64), (3, 256, 128), (2, 33, 17), (1, 16, 8), (4, 1, 1), (2, 300, 260), (1, 576, 512)],
)
def test_other_head_dims_match_fp64(heads):
    """Dqk and Dv equal and apart, odd ones and ones not a multiple of 64 (the packed K and V and
    the query tile are zero past them), small ones, and ones past 256 (taken 256 at a time)."""
    spec = BatchSpec([5, 70, 1], [9, 300, 1])
    (q, k, v, q_cu, kv_cu), out, lse = _run(spec, True, heads)
    want_out, want_lse = attention_fp64(
        q, k, v, q_cu.tolist(), kv_cu.tolist(), causal=True, scale=heads[1] ** -0.5
    )
    assert (out.double() - want_out).abs().max() < 1e-2
    assert (lse.double() - want_lse).abs().max() < 1e-3


@pytest.mark.native
def test_agrees_with_the_other_kernels():
    """The same batch through native, torch and (where it runs) zentorch: as close to each other
    as bf16 outputs allow."""
    spec = BatchSpec([128, 33, 512], [128, 300, 512])
    got = {}
    for kernel in ("native", "torch", "zentorch"):
        if kernel == "zentorch" and probes.host_facts().zentorch_failure:
            continue
        got[kernel] = _run(spec, True, kernel=kernel)[1:]
    for kernel, (out, lse) in got.items():
        assert (out.float() - got["native"][0].float()).abs().max() < 2e-2, kernel
        assert (lse - got["native"][1]).abs().max() < 1e-3, kernel


@pytest.mark.native
def test_thread_count_changes_nothing():
    """Each (sequence, head, query block) is computed by one thread alone, in a fixed order:
    the result is bitwise the same on 1 thread and on all of them."""
    spec = BatchSpec([300, 64, 5], [300, 500, 5])
    threads = torch.get_num_threads()
    (_, out_all, lse_all) = _run(spec, True)
    try:
        torch.set_num_threads(1)
        (_, out_one, lse_one) = _run(spec, True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out_all, out_one) and torch.equal(lse_all, lse_one)


@pytest.mark.native
@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"q_cu": torch.tensor([0, 20, 91])}, "within q and k"),  # one past q's last token
        ({"kv_cu": torch.tensor([0, 30, 20])}, "must rise"),
        ({"q_cu": torch.tensor([-1, 20, 90])}, "negative"),
        ({"bn": 48}, "bad blocks"),  # not whole 32s: a tail block would pass its scratch
        ({"lse": torch.zeros(2, 89)}, "lse shape"),
        ({"out": torch.zeros(89, 2, 128, dtype=torch.bfloat16)}, "token counts"),
        ({"q_cu": torch.tensor([0, 20, 90], dtype=torch.int32)}, "Long"),
    ],
    ids=["past_q", "falling", "negative", "bn_48", "lse_shape", "out_rows", "int32_cu"],
)
def test_the_entry_point_refuses_what_would_read_or_write_out_of_bounds(change, says):
    """The module's own checks, under the Python kernel's validation: every offset and size it
    would read or write by, refused with a RuntimeError that says which, never a crash."""
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(90, 2, 192, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(90, 2, 128, generator=gen).bfloat16()
    args = {
        "q_cu": torch.tensor([0, 20, 90]),
        "kv_cu": torch.tensor([0, 30, 90]),
        "out": torch.zeros(90, 2, 128, dtype=torch.bfloat16),
        "lse": torch.zeros(2, 90),
        "bn": 256,
    } | change
    module, _ = native.native_module()
    assert module is not None
    with pytest.raises(RuntimeError, match=says):
        torch.ops.zen_mla.native_attend(
            q, k, v, args["q_cu"], args["kv_cu"], 192**-0.5, True, args["out"], args["lse"],
            128, args["bn"], 0, None, native.native_isa(),
        )  # fmt: skip


@pytest.mark.native
def test_strided_inputs_and_outputs():
    """q/k/v slices of a fused buffer are read in place; an `out` and `lse` that are views with
    other strides are written right."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(90, 2, 192 * 2 + 128, generator=gen).bfloat16()
    q, k, v = qkv[..., :192], qkv[..., 192:384], qkv[..., 384:]
    cu = torch.tensor([0, 20, 90])
    batch = validate(q, k, v, cu, None, causal=True, scale=None)
    out = torch.zeros(2, 90, 128, dtype=torch.bfloat16).transpose(0, 1)  # [90, 2, 128] strided
    lse = torch.zeros(90, 2).t()  # [2, 90], strided
    native.NativeKernel.forward_ragged(batch, out, lse)
    want_out, want_lse = zen_mla.ragged_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), cu, return_lse=True, kernel="native"
    )
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    last_dim_strided = torch.zeros(90, 2, 256, dtype=torch.bfloat16)[..., ::2]
    native.NativeKernel.forward_ragged(batch, last_dim_strided, None)
    assert torch.equal(last_dim_strided, want_out)


@pytest.mark.native
def test_many_threads_at_once_each_get_their_own_answer():
    """Calls from several Python threads at once (the GIL is released in the kernel) share the
    kept packing buffer by ownership: every answer is its own batch's."""
    specs = [BatchSpec([40 * (i + 1), 3], [40 * (i + 1) + 50, 600]) for i in range(6)]
    batches = [make_batch(spec, MLA, torch.bfloat16, seed=i) for i, spec in enumerate(specs)]
    want = [zen_mla.ragged_attention(*b, kernel="native") for b in batches]
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(batches))}

    def client(i: int) -> None:
        for _ in range(4):
            got[i].append(zen_mla.ragged_attention(*batches[i], kernel="native"))

    workers = [threading.Thread(target=client, args=(i,)) for i in range(len(batches))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for i, outs in got.items():
        assert len(outs) == 4 and all(torch.equal(o, want[i]) for o in outs), i


@pytest.mark.native
def test_large_scores_keep_an_fp32_accurate_lse():
    """|scores| ~ 100: the LSE comes from fp32 scores, not from bf16-rounded ones."""
    q, k, v, q_cu, kv_cu = make_batch(BatchSpec([64, 17], [256, 300]), MLA, torch.bfloat16)
    q, k = q * 4, k * 4
    _, lse = zen_mla.ragged_attention(
        q, k, v, q_cu, kv_cu, causal=False, return_lse=True, kernel="native"
    )
    _, want = attention_fp64(q, k, v, q_cu.tolist(), kv_cu.tolist(), causal=False, scale=192**-0.5)
    assert want.abs().max() > 50 and (lse.double() - want).abs().max() <= 1e-3


@pytest.mark.native
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("keys", ["rising", "jump"])
def test_scores_that_rise_along_a_row_keep_out_and_lse_accurate(keys, causal):
    """A row's P is taken against the max of its earlier key blocks while the block's sum stays
    under 2^64, else against the exact max: scores that rise gradually along the keys take the
    first way, keys ~600x larger past the middle (scores beyond 2^64 of the earlier max) the
    second. Out and LSE against fp64 either way."""
    t = 1500
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, 4, 192, generator=gen)
    growth = torch.linspace(0.1, 3, t) if keys == "rising" else (torch.arange(t) >= t // 2) * 30.0
    k = torch.randn(t, 4, 192, generator=gen) * (growth + 0.05)[:, None, None]
    v = torch.randn(t, 4, 128, generator=gen)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    cu = torch.tensor([0, t])
    out, lse = zen_mla.ragged_attention(
        q, k, v, cu, cu, causal=causal, return_lse=True, kernel="native"
    )
    want, want_lse = attention_fp64(q, k, v, [0, t], [0, t], causal=causal, scale=192**-0.5)
    assert want_lse.max() > (50 if keys == "jump" else 5)  # the later keys dominate
    assert (lse.double() - want_lse).abs().max() <= 1e-4
    assert (out.double() - want).abs().max() < 3e-2


@pytest.mark.parametrize(
    ("module", "unbuilt", "paths", "wanted", "says"),
    [
        (None, "the C++ build failed: g++: not found", [], "", "the C++ build failed: g++"),
        (None, None, [], "", "it was not built"),
        ("module", None, [], "", "needs AVX-512 BF16 or AVX2 with FMA"),
        ("module", None, ["avx2"], "avx512", "ZEN_MLA_NATIVE_ISA=avx512, a path this CPU lacks"),
        ("module", None, ["avx512", "avx2"], "sse4", "must be auto, avx512 or avx2, not 'sse4'"),
    ],
    ids=["build_failed", "never_built", "cpu_lacks_both", "forced_path_absent", "unknown_path"],
)
def test_why_it_is_unavailable(monkeypatch, tmp_path, module, unbuilt, paths, wanted, says):
    """Where the build failed (setup.py leaves its reason beside the package), was skipped, the
    CPU runs none of the kernel's paths, or `ZEN_MLA_NATIVE_ISA` names one it does not run or
    none at all, the reason reaches `host_kernels()` and "auto" passes the kernel over."""

    class FakeModule:
        @staticmethod
        def cpu_paths() -> list[str]:
            return paths

    def load():
        if module is None:
            raise ImportError(f"No module named {native.EXTENSION!r}")
        return FakeModule

    reason_file = tmp_path / "_native_unbuilt.txt"
    if unbuilt is not None:
        reason_file.write_text(unbuilt + "\n")
    monkeypatch.setattr(native, "_UNBUILT", reason_file)
    monkeypatch.setattr(native, "_load", load)
    monkeypatch.setenv(native.ISA_VARIABLE, wanted)
    native.native_module.cache_clear()
    native.native_isa.cache_clear()
    probes._native_probe.cache_clear()
    try:
        probed = probes.probe_host_facts()
        assert says in probed.native_failure
        monkeypatch.setattr(probes, "host_facts", lambda: probed)
        status = zen_mla.host_kernels()
        assert status["native"] == {"ok": False, "reason": probed.native_failure, "path": None}
        assert (
            status["auto"]["out"]["kernel"] != "native" and says in status["auto"]["out"]["reason"]
        )
        batch = make_batch(BatchSpec([3]), MLA, torch.bfloat16)
        assert zen_mla.ragged_attention(*batch).shape == (3, 4, 128)
        with pytest.raises(zen_mla.KernelUnavailableError, match=re.escape(says)):
            zen_mla.ragged_attention(*batch, kernel="native")
    finally:
        native.native_module.cache_clear()
        native.native_isa.cache_clear()
        probes._native_probe.cache_clear()
