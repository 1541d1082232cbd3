from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zen_mla
from zen_mla.attention import select
from zen_mla.attention.kernels.zentorch import zentorch_op


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
