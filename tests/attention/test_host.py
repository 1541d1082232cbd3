"""This host's facts (zen_mla.attention.host): the CPU as /proc/cpuinfo describes it."""

from __future__ import annotations

from pathlib import Path

from tests.attention.this_host import cpu_is_zen
from zen_mla.attention.host import cpu_facts


def test_cpu_facts_match_proc_cpuinfo():
    text = Path("/proc/cpuinfo").read_text()
    facts = cpu_facts()
    assert f"vendor_id\t: {facts.vendor}" in text
    assert f"cpu family\t: {facts.family}\n" in text
    assert facts.avx512_bf16 == (" avx512_bf16" in text)
    assert facts.zen == cpu_is_zen()
