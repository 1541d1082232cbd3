"""Who a caller is, as the operator says (docs/protocol.md, "Limits"), on a real server: a forwarded
address counts only from a proxy the operator names, tenants are told apart by their tokens
even from one address, and many clients holding some keep neither a newcomer's upload nor its
queued work out (the attacks from other loopback addresses, each a client of its own)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import zen_mla
from tests.processes import wait_for
from tests.service.attacks import LOCKOUT_S, during, legitimate, silent_heads
from tests.service.bodies import OCTET, body_of, good_tensors
from tests.service.raw import MIB, prefill_head
from tests.service.servers import Server, serve
from zen_mla import SharedMemoryUnavailableError
from zen_mla.client import PrefillClient

pytestmark = pytest.mark.slow


def _callers(server: Server) -> list[str]:
    """The callers the server's log lines name, in order."""
    names = []
    for line in server.logs().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if "caller" in event:
                names.append(event["caller"])
    return names


def _slow_body() -> bytes:
    """Work of about a second on the fp32 reference kernel (2048 tokens, 8 heads, non-causal)."""
    tensors = {
        "q": torch.randn(2048, 8, 192).bfloat16(),
        "k": torch.randn(2048, 8, 192).bfloat16(),
        "v": torch.randn(2048, 8, 128).bfloat16(),
        "q_cu_seq_lens": torch.tensor([0, 2048], dtype=torch.int32),
    }
    return body_of(tensors, {"kernel": "reference", "causal": "false"})


def _post(server: Server, headers: dict[str, str], source: str = "127.0.0.1") -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(base_url=server.url, transport=transport, timeout=60) as c:
        return c.post("/prefill", content=body_of(good_tensors()), headers=OCTET | headers)


def test_a_forwarded_address_counts_only_from_a_proxy_the_operator_names(tmp_path: Path):
    forged = {"X-Forwarded-For": "10.9.9.9"}
    with serve(tmp_path, workers=1, log=tmp_path / "default.log") as s:
        assert _post(s, forged).status_code == 200
        wait_for(lambda: _callers(s)[-1:] == ["addr:127.0.0.1"], 10, "a header named the caller")
    with serve(
        tmp_path, workers=1, forwarded_allow_ips="127.0.0.1", log=tmp_path / "proxied.log"
    ) as s:
        assert _post(s, forged).status_code == 200
        wait_for(lambda: _callers(s)[-1:] == ["addr:10.9.9.9"], 10, "the proxy's caller")
        # another peer is no proxy of the operator's: its header counts for nothing
        assert _post(s, forged, source="127.0.0.2").status_code == 200
        wait_for(lambda: _callers(s)[-1:] == ["addr:127.0.0.2"], 10, "the peer itself")


@pytest.fixture
def tenants_file(tmp_path: Path) -> str:
    path = tmp_path / "tenants"
    path.write_text("team-a token-a\nteam-b token-b\n")
    return str(path)


def test_tenants_are_told_apart_by_their_tokens_from_one_address(tmp_path, tenants_file):
    """Two tenants on one address are two callers, the shared token a third; no token, or
    one that opens nothing, is a 401. Tenant A floods the queue; B, from the same address,
    gets every request through within LOCKOUT_S, answered right."""
    with serve(
        tmp_path,
        workers=1,
        tenants_file=tenants_file,
        api_token="shared-token",
        max_queue=2,
    ) as s:
        for token, caller in [("token-a", "tenant:team-a"), ("shared-token", "tenant:*")]:
            assert _post(s, {"Authorization": f"Bearer {token}"}).status_code == 200
            wait_for(lambda c=caller: _callers(s)[-1:] == [c], 10, f"{caller} in the log")
        for bad in ({}, {"Authorization": "Bearer token-c"}, {"Authorization": "token-a"}):
            assert _post(s, bad).status_code == 401
        # on the region socket, the hello's token names the tenant its calls count for
        tensors = good_tensors()
        expected = zen_mla.ragged_attention(
            tensors["q"], tensors["k"], tensors["v"], tensors["q_cu_seq_lens"]
        )
        with PrefillClient(s.url, token="token-b", shared_memory=True) as c:
            out = c.prefill(tensors["q"], tensors["k"], tensors["v"], tensors["q_cu_seq_lens"])
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        wait_for(lambda: "tenant:team-b" in _callers(s), 10, "a socket call's tenant")
        with (
            pytest.raises(SharedMemoryUnavailableError, match="bearer token"),
            PrefillClient(s.url, shared_memory=True) as c,
        ):
            c.prefill(tensors["q"], tensors["k"], tensors["v"], tensors["q_cu_seq_lens"])

        flood_body = _slow_body()

        def flood(stop: threading.Event) -> None:
            def one() -> None:
                with httpx.Client(base_url=s.url, timeout=60) as c:
                    while not stop.is_set():
                        c.post(
                            "/prefill",
                            content=flood_body,
                            headers=OCTET | {"Authorization": "Bearer token-a"},
                        )

            senders = [threading.Thread(target=one) for _ in range(6)]
            for t in senders:
                t.start()
            for t in senders:
                t.join()

        def tenant_b() -> float:
            t0 = time.monotonic()
            while time.monotonic() - t0 < LOCKOUT_S:
                answer = _post(s, {"Authorization": "Bearer token-b"})
                if answer.status_code == 200:
                    return time.monotonic() - t0
                assert answer.status_code == 429, answer.text
                time.sleep(0.2)
            raise AssertionError(f"tenant B locked out for {LOCKOUT_S} s")

        during(flood, s, tenant_b, settle_s=2, rounds=4)
        assert "tenant:team-b" in _callers(s)


LOOPBACKS = [f"127.0.0.{i}" for i in range(3, 11)]  # eight hosts; the legitimate one is .2


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Server]:
    with serve(
        tmp_path,
        workers=1,
        max_uploads=4,
        max_queue=4,
        body_grace_s=1.0,
        max_body_bytes=64 * MIB,
        max_inflight_bytes=512 * MIB,
    ) as s:
        yield s


def test_head_only_uploads_from_eight_addresses_leave_a_newcomer_a_slot(small):
    """Eight addresses keep uploads that send only their head, each reopened within 5 ms of
    its 408: a client from a ninth gets every upload through (5 of 5), answered right."""
    head = prefill_head(32 * MIB)
    latencies = during(
        lambda stop: silent_heads(small, head, 16, stop, sources=LOOPBACKS, poll_s=0.005),
        small,
        lambda: legitimate(small, upload=True),
        settle_s=2,
        rounds=5,
        pause_s=0.3,
    )
    assert len(latencies.seconds) >= 5


def test_a_queue_flood_from_four_addresses_leaves_a_fifth_every_request(small):
    """Four addresses keep the queue (4 places) full of slow work; a client from a fifth gets
    every request through (7 of 7) within LOCKOUT_S each, answered right."""
    body = _slow_body()

    def flood(stop: threading.Event) -> None:
        def one(source: str) -> None:
            transport = httpx.HTTPTransport(local_address=source)
            with httpx.Client(base_url=small.url, transport=transport, timeout=60) as c:
                while not stop.is_set():
                    c.post("/prefill", content=body, headers=OCTET)

        senders = [threading.Thread(target=one, args=(a,)) for a in LOOPBACKS[:4] * 3]
        for t in senders:
            t.start()
        for t in senders:
            t.join()

    latencies = during(flood, small, lambda: legitimate(small), settle_s=2, rounds=7)
    assert len(latencies.seconds) >= 7
