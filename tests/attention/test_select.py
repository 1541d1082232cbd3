"""Kernel selection (zen_mla.attention.select): what this host offers, what its probes reject,
and the kernel name a caller asks for, refused with a named error when unknown or absent."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import zen_mla
from zen_mla import InvalidInputError, KernelUnavailableError
from zen_mla.attention import select
from zen_mla.attention.kernels.zentorch import zentorch_op


def _small():
    q = torch.randn(10, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(12, 2, 16, dtype=torch.bfloat16)
    v = torch.randn(12, 2, 8, dtype=torch.bfloat16)
    q_cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    kv_cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu, "kv_cu_seq_lens": kv_cu}


def test_status_has_the_contract_fields():
    status = zen_mla.zentorch_status()
    assert set(status) >= {"installed", "version", "ops", "cpu", "auto_kernel", "reason"}
    assert isinstance(status["ops"]["zentorch_sdpa"], bool)
    assert set(status["cpu"]) >= {"vendor", "model", "avx512_bf16"}
    assert status["auto_kernel"] in ("zentorch", "torch")
    if status["auto_kernel"] == "zentorch":
        assert status["ops"]["zentorch_sdpa"] and status["cpu"]["zen"]
    if status["ops"]["zentorch_sdpa"]:
        assert status["installed"] and status["version"]
    assert status["lse_kernel"] in ("zentorch", "torch") and status["lse_reason"]
    if status["lse_kernel"] == "zentorch":
        assert status["auto_kernel"] == "zentorch" and status["ops"]["zentorch_sdpa_lse"]
    assert status["ops"]["zentorch_sdpa_lse"] <= status["ops"]["zentorch_sdpa"]


def test_cpu_facts_match_proc_cpuinfo():
    text = Path("/proc/cpuinfo").read_text()
    facts = select.cpu_facts()
    assert f"vendor_id\t: {facts.vendor}" in text
    assert facts.avx512_bf16 == (" avx512_bf16" in text)


@pytest.mark.zentorch
def test_probe_rejects_an_op_that_gives_wrong_numbers():
    def broken(q, k, v, *args, **kwargs):
        return torch.zeros_like(q), None

    def raising(*args, **kwargs):
        raise RuntimeError("Illegal instruction")

    assert select.probe_op(zentorch_op()) == ""
    assert "disagrees" in select.probe_op(broken)
    assert "raised on this CPU" in select.probe_op(raising)


def test_an_unknown_kernel_is_named():
    with pytest.raises(InvalidInputError) as info:
        zen_mla.ragged_attention(**_small(), kernel="flash")
    assert isinstance(info.value, ValueError)
    assert info.value.name == "kernel"
    assert str(info.value).startswith("kernel: expected ")
    assert "one of auto, zentorch, torch, reference" in str(info.value)
    assert "got" in str(info.value)


def test_forcing_zentorch_where_absent_is_a_clear_error(monkeypatch):
    absent = dataclasses.replace(
        select.host_status(),
        installed=False,
        version=None,
        sdpa_ok=False,
        sdpa_lse_ok=False,
        auto_kernel="torch",
        reason="zentorch is not installed",
        lse_kernel="torch",
        lse_reason="zentorch is not installed",
    )
    monkeypatch.setattr(select, "host_status", lambda: absent)
    assert zen_mla.zentorch_status()["auto_kernel"] == "torch"
    with pytest.raises(KernelUnavailableError, match="zentorch is not installed") as info:
        zen_mla.ragged_attention(**_small(), kernel="zentorch")
    assert isinstance(info.value, ValueError) and info.value.name == "kernel"
    assert zen_mla.ragged_attention(**_small(), kernel="auto").shape == (10, 2, 8)
