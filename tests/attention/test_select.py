"""Kernel selection (zen_mla.attention's probes, auto, select and status): what this host
offers, what its probes reject, each kernel's own word on whether it runs here, "auto" as the
first that suits it, and the kernel name a caller asks for, refused with a named error when
unknown or absent."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import zen_mla
from tests.attention.this_host import native_runs, zentorch_runs
from tests.reference import attention_fp64
from zen_mla import InvalidInputError, KernelUnavailableError
from zen_mla.attention import probes
from zen_mla.attention.auto import auto_choice
from zen_mla.attention.batch import validate
from zen_mla.attention.driver import attend
from zen_mla.attention.kernels import KERNELS, TorchFlashKernel, ZentorchKernel
from zen_mla.attention.kernels.zentorch import zentorch_op
from zen_mla.attention.status import host_status

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: whether each registered kernel runs on this host, found without zen_mla's probes
RUNS_HERE = {
    "native": native_runs,
    "zentorch": zentorch_runs,
    "torch": lambda: True,
    "reference": lambda: True,
}
#: "auto"'s kernels, in order of preference
AUTO_KERNELS = ("native", "zentorch", "torch")


def _small():
    q = torch.randn(10, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(12, 2, 16, dtype=torch.bfloat16)
    v = torch.randn(12, 2, 8, dtype=torch.bfloat16)
    q_cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    kv_cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu, "kv_cu_seq_lens": kv_cu}


def test_host_kernels_has_its_fields():
    status = zen_mla.host_kernels()
    assert set(status) == {"auto", "native", "zentorch", "cpu"}
    assert set(status["zentorch"]) == {"installed", "version", "ops"}
    assert set(status["auto"]) == {"out", "lse"}
    assert set(status["auto"]["out"]) == {"kernel", "reason", "calibration"}
    assert isinstance(status["zentorch"]["ops"]["zentorch_sdpa"], bool)
    assert set(status["cpu"]) >= {"vendor", "model", "avx512_bf16"}
    assert status["auto"]["out"]["kernel"] in AUTO_KERNELS
    if status["auto"]["out"]["kernel"] == "zentorch":
        assert status["zentorch"]["ops"]["zentorch_sdpa"]
    if status["auto"]["out"]["kernel"] == "native":
        assert status["native"]["ok"]
    if status["zentorch"]["ops"]["zentorch_sdpa"]:
        assert status["zentorch"]["installed"] and status["zentorch"]["version"]
    assert status["auto"]["lse"]["kernel"] in AUTO_KERNELS and status["auto"]["lse"]["reason"]
    if status["auto"]["lse"]["kernel"] == "zentorch":
        assert status["zentorch"]["ops"]["zentorch_sdpa_lse"]
    assert (
        status["zentorch"]["ops"]["zentorch_sdpa_lse"] <= status["zentorch"]["ops"]["zentorch_sdpa"]
    )
    assert set(status["native"]) == {"ok", "reason", "path"}
    assert (status["native"]["reason"] is None) == status["native"]["ok"]
    assert (status["native"]["path"] in ("avx512", "avx2")) == status["native"]["ok"]
    for mode in ("out", "lse"):
        kernel, calibration = status["auto"][mode]["kernel"], status["auto"][mode]["calibration"]
        if calibration is not None:  # None where one kernel suits "auto"
            relative = calibration["relative"]
            assert calibration["winner"] == kernel and relative[kernel] == min(relative.values())


@pytest.mark.zentorch
def test_zentorch_status_is_host_kernels_under_its_deprecated_name():
    """Clients read `zentorch_status()`'s keys: the old name warns and gives the same facts in
    its earlier form."""
    with pytest.warns(DeprecationWarning, match="host_kernels"):
        old = zen_mla.zentorch_status()
    new = zen_mla.host_kernels()
    assert {k: old[k] for k in ("installed", "version", "ops")} == new["zentorch"]
    assert old["cpu"] == new["cpu"] and old["native"] == new["native"]
    for mode, prefix in (("out", ""), ("lse", "lse_")):
        assert (
            old[f"{prefix}kernel" if mode == "lse" else "auto_kernel"]
            == new["auto"][mode]["kernel"]
        )
        assert old[f"{prefix}reason"] == new["auto"][mode]["reason"]
        assert old["calibration"][mode] == new["auto"][mode]["calibration"]


def test_probe_rejects_an_op_that_gives_wrong_numbers():
    def broken(q, k, v, *args, **kwargs):
        return torch.zeros_like(q), None

    def raising(*args, **kwargs):
        raise RuntimeError("Illegal instruction")

    assert probes.probe_op(zentorch_op()) is None
    assert "disagrees" in probes.probe_op(broken)
    assert "raised on this CPU" in probes.probe_op(raising)


def test_an_unknown_kernel_is_named():
    with pytest.raises(InvalidInputError) as info:
        zen_mla.ragged_attention(**_small(), kernel="flash")
    assert isinstance(info.value, ValueError)
    assert info.value.name == "kernel"
    assert str(info.value).startswith("kernel: expected ")
    assert "one of auto, native, zentorch, torch, reference" in str(info.value)
    assert "got" in str(info.value)


def test_forcing_zentorch_where_absent_is_a_clear_error(monkeypatch):
    absent = dataclasses.replace(
        probes.host_facts(),
        zentorch_installed=False,
        zentorch_version=None,
        zentorch_failure="zentorch is not installed",
        zentorch_lse_failure="zentorch is not installed",
        native_failure="zen-mla's native kernel is not available: it was not built",
    )
    monkeypatch.setattr(probes, "host_facts", lambda: absent)
    assert zen_mla.host_kernels()["auto"]["out"]["kernel"] == "torch"
    assert zen_mla.host_kernels()["auto"]["out"]["reason"] == (
        "zen-mla's native kernel is not available: it was not built; zentorch is not installed; "
        + TorchFlashKernel.auto_reason
    )
    assert zen_mla.host_kernels()["native"] == {
        "ok": False,
        "reason": "zen-mla's native kernel is not available: it was not built",
        "path": None,
    }
    with pytest.raises(KernelUnavailableError, match="zentorch is not installed") as info:
        zen_mla.ragged_attention(**_small(), kernel="zentorch")
    assert isinstance(info.value, ValueError) and info.value.name == "kernel"
    assert zen_mla.ragged_attention(**_small(), kernel="auto").shape == (10, 2, 8)


def _lse_close_to_fp64(kernel) -> bool:
    """The kernel's LSE on one causal MLA-shaped case is within 1e-3 of fp64."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(33, 2, 192, generator=gen).bfloat16() for _ in range(3))
    cu = torch.tensor([0, 33])
    _, lse = attend(validate(q, k, v, cu, cu, causal=True, scale=None), kernel, return_lse=True)
    _, want = attention_fp64(q, k, v, [0, 33], [0, 33], causal=True, scale=192**-0.5)
    return bool((lse.double() - want).abs().max() < 1e-3)


@pytest.mark.parametrize("name", KERNELS)
def test_each_kernel_says_whether_it_runs_here(name):
    """Each kernel's reasons agree with this host's facts, found without zen_mla's probes."""
    assert set(RUNS_HERE) == set(KERNELS), "a new kernel needs its fact here"
    kernel, host = KERNELS[name], probes.host_facts()
    reason = kernel.unavailable_reason(host)
    if not RUNS_HERE[name]():
        assert isinstance(reason, str) and reason, f"{name} does not run here, yet gives no reason"
        return
    assert reason is None
    unsuited = kernel.auto_unsuited_reason(host)
    # "auto" takes any kernel that runs here but the fp32 reference; speed is measured
    assert (unsuited is None) == (name != "reference")
    lse_reason = kernel.lse_unavailable_reason(host)
    if lse_reason is None:
        assert _lse_close_to_fp64(kernel), f"{name} says its LSE is trusted, yet it is off"
    else:
        assert kernel is ZentorchKernel and lse_reason == host.zentorch_lse_failure


def test_zentorch_not_installed_is_the_reason_where_it_is_absent():
    if importlib.util.find_spec("zentorch") is not None:
        pytest.skip("zentorch is installed here")
    assert "not installed" in (ZentorchKernel.unavailable_reason(probes.host_facts()) or "")


def _suitable(dtype: torch.dtype, return_lse: bool) -> list[str]:
    """The kernels "auto" chooses among, by this host's facts found without zen_mla's probes."""
    runs = [name for name in AUTO_KERNELS if RUNS_HERE[name]() and dtype in KERNELS[name].dtypes]
    if return_lse:
        host = probes.host_facts()
        runs = [name for name in runs if KERNELS[name].lse_unavailable_reason(host) is None]
    return runs


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_auto_takes_the_kernel_measured_fastest_of_those_that_suit_it(dtype, return_lse):
    """Where several kernels suit "auto", the calibration's winner; where one, that one."""
    suitable = _suitable(dtype, return_lse)
    choice = zen_mla.kernel_choice("auto", dtype, return_lse=return_lse)
    assert choice.out in suitable and choice.lse == (choice.out if return_lse else None)
    if len(suitable) > 1:
        calibration = auto_choice(probes.host_facts(), dtype, lse=return_lse).calibration
        assert calibration is not None and set(calibration.seconds) == set(suitable)
        assert choice.out == calibration.winner
        relative = calibration.relative
        assert relative[choice.out] == min(relative.values())


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
def test_with_calibration_off_auto_takes_the_first_in_order(monkeypatch, return_lse):
    monkeypatch.setenv("ZEN_MLA_CALIBRATE", "0")
    suitable = _suitable(torch.bfloat16, return_lse)
    auto = auto_choice(probes.host_facts(), torch.bfloat16, lse=return_lse)
    assert auto.kernel.name == suitable[0] and auto.calibration is None
    if len(suitable) > 1:
        assert auto.reason.endswith("first in order of preference (ZEN_MLA_CALIBRATE is off)")


def test_the_status_says_which_kernel_won_and_by_how_much():
    """The reason names the winner and each other kernel's time over its own, from the
    calibration `zentorch_status()` reports; the kernels before the first suitable one are
    named with why they were passed over."""
    status = zen_mla.host_kernels()
    host = probes.host_facts()
    suitable = _suitable(torch.bfloat16, False)
    first = KERNELS[suitable[0]]
    passed_over = [
        KERNELS[name].unavailable_reason(host)
        for name in AUTO_KERNELS[: AUTO_KERNELS.index(first.name)]
    ]
    chosen = KERNELS[status["auto"]["out"]["kernel"]]
    assert status["auto"]["out"]["reason"].startswith("; ".join([*passed_over, chosen.auto_reason]))
    calibration = host_status().calibration
    if len(suitable) == 1:
        assert calibration is None and status["auto"]["out"]["calibration"] is None
        return
    assert calibration is not None and status["auto"]["out"]["calibration"] == calibration.as_dict()
    assert f"{chosen.name} measured fastest here (" in status["auto"]["out"]["reason"]
    relative = calibration.relative
    for name in relative:
        if name != chosen.name:
            times = relative[name] / relative[chosen.name]
            assert (
                times >= 1.0 and f"{name} {times:.2f}x its time" in status["auto"]["out"]["reason"]
            )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", KERNELS)
def test_a_forced_kernel_runs_or_says_its_own_reason(name, dtype):
    kernel, host = KERNELS[name], probes.host_facts()
    reason = kernel.unavailable_reason(host)
    declines_dtype = dtype not in kernel.dtypes
    if reason is None and not declines_dtype:
        assert zen_mla.kernel_choice(name, dtype).out == name
        return
    q = torch.randn(6, 2, 16).to(dtype)
    v = torch.randn(6, 2, 8).to(dtype)
    cu = torch.tensor([0, 2, 6])
    with pytest.raises(KernelUnavailableError) as info:
        zen_mla.ragged_attention(q, q, v, cu, kernel=name)
    assert info.value.name == "kernel" and info.value.got == repr(name)
    if reason is not None:
        assert f"{name!r} cannot: {reason}" in str(info.value)
    else:
        assert f"{name!r} cannot: it takes {kernel.dtypes[0]}" in str(info.value)
