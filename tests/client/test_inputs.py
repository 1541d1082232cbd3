"""What the client reads of a request before sending it (cu_seq_lens, to weigh it between
endpoints) is checked first: a malformed one is an InvalidInputError naming it, raised before a
byte is sent, never a Python error from the weighing (IndexError, TypeError before)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import zen_mla
from zen_mla.client import AsyncPrefillClient, PrefillClient

URL = "http://127.0.0.1:9"  # nothing listens: a request that got this far would fail otherwise
Q = torch.zeros(4, 2, 16)
V = torch.zeros(4, 2, 8)
CU = torch.tensor([0, 1, 4], dtype=torch.int32)

BAD = {
    "kv_shorter": ("kv_cu_seq_lens", CU, torch.tensor([0, 4], dtype=torch.int32)),
    "q_0d": ("q_cu_seq_lens", torch.tensor(4, dtype=torch.int32), None),
    "q_2d": ("q_cu_seq_lens", CU.view(1, 3), None),
    "q_empty": ("q_cu_seq_lens", torch.zeros(0, dtype=torch.int32), None),
    "q_float": ("q_cu_seq_lens", CU.float(), None),
    "kv_float": ("kv_cu_seq_lens", CU, CU.double()),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_malformed_cu_seq_lens_is_named_before_anything_is_sent(kind, case):
    name, q_cu, kv_cu = case
    with pytest.raises(zen_mla.InvalidInputError) as info:
        if kind == "sync":
            with PrefillClient(URL, shared_memory=False, retries=0, timeout=5) as client:
                client.prefill(Q, Q, V, q_cu, kv_cu)
        else:

            async def main() -> None:
                async with AsyncPrefillClient(
                    URL, shared_memory=False, retries=0, timeout=5
                ) as client:
                    await client.prefill(Q, Q, V, q_cu, kv_cu)

            asyncio.run(main())
    assert info.value.name == name
