"""MLA's latent cache through same-host regions, on a real `zen-mla serve` with tenants: a weight
registered from where it lies in the caller's region (over HTTP, `PUT /weights/{name}` with a
regions JSON body, and on the region socket, a `weight` frame), copied and charged to the caller
before the copy; latent requests naming `kv_c` and `k_pe` in a region, over HTTP and on the
socket, answered equal to in-process `latent_attention`; the weight unchanged when the client
writes its region after; a weight forgotten on the socket; bad places refused naming
`w_kv_b`, the service healthy after; the clients' latent calls on the region socket."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re

import pytest
import torch

from tests.processes import wait_for
from tests.service.region_clients import REGION_JSON, region_socket
from tests.service.servers import serve, server_fixture
from zen_mla import ZenMLAError
from zen_mla.attention.latent import latent_attention
from zen_mla.client import AsyncPrefillClient, PrefillClient
from zen_mla.regions.connection import ClientRegion, RegionConnection
from zen_mla.regions.protocol import call_fields, send_frame
from zen_mla.wire import regions_json as rr

H, RANK, ROPE, NOPE, DV = 4, 64, 16, 32, 32
A = {"Authorization": "Bearer token-a"}
B = {"Authorization": "Bearer token-b"}


@server_fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("weights-regions")
    tenants = tmp / "tenants"
    tenants.write_text("team-a token-a\nteam-b token-b\n")
    with serve(tmp, workers=2, tenants_file=str(tenants), max_weight_bytes=1 << 20) as s:
        yield s


class Laid:
    """A weight and a latent request laid out one after another in one region of the client's,
    filled: the places a request names, and the tensors by name."""

    def __init__(self, region: ClientRegion, q_lens: list[int], kv_lens: list[int], seed: int):
        gen = torch.Generator().manual_seed(seed)
        tq, tk = sum(q_lens), sum(kv_lens)
        values = {
            "w_kv_b": (torch.randn(H * (NOPE + DV), RANK, generator=gen) / RANK**0.5).bfloat16(),
            "q": torch.randn(tq, H, NOPE + ROPE, generator=gen).bfloat16(),
            "kv_c": torch.randn(tk, RANK, generator=gen).bfloat16(),
            "k_pe": torch.randn(tk, ROPE, generator=gen).bfloat16(),
            "q_cu_seq_lens": torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]).int(),
            "kv_cu_seq_lens": torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()]).int(),
            "out": torch.zeros(tq, H, DV).bfloat16(),
            "lse": torch.zeros(H, tq),
        }
        self.places: dict[str, rr.TensorPlace] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        offset = 0
        for name, t in values.items():
            view = region.tensor(offset, tuple(t.shape), t.dtype)
            view.copy_(t)
            self.places[name] = region.place(offset, view)
            self.tensors[name] = view
            offset += -(-t.nbytes // 64) * 64

    def request(self) -> dict[str, rr.TensorPlace]:
        """The request's places: all but the weight."""
        return {n: p for n, p in self.places.items() if n != "w_kv_b"}

    def want(self, w_kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tensors
        return latent_attention(
            t["q"], t["kv_c"], t["k_pe"], w_kv_b, t["q_cu_seq_lens"], t["kv_cu_seq_lens"],
            return_lse=True,
        )  # fmt: skip

    def check(self, w_kv_b: torch.Tensor) -> None:
        """out and lse as written in the region: in-process latent_attention's with `w_kv_b`."""
        want, want_lse = self.want(w_kv_b)
        assert (self.tensors["out"].float() - want.float()).abs().max().item() <= 2**-6
        assert (self.tensors["lse"] - want_lse).abs().max().item() <= 1e-4


def _held(c) -> int:
    return int(c.get("/health").json()["held_bytes"]["weight"])


def _names(c, auth: dict) -> list[str]:
    return [e["name"] for e in c.get("/weights", headers=auth).json()]


def _connect(server) -> contextlib.closing[RegionConnection]:
    return contextlib.closing(RegionConnection(region_socket(server), "token-a"))


def _post(c, laid: Laid, meta: dict, auth: dict):
    """The latent request `laid` names, as a regions JSON over HTTP."""
    return c.post("/prefill", content=rr.encode(laid.request(), meta), headers=auth | REGION_JSON)


def _socket_call(conn: RegionConnection, places: dict, meta: dict) -> dict:
    reply = conn.try_call(call_fields({"body": rr.encode(places, meta).decode()}), 60)
    assert reply is not None
    return reply


def test_a_weight_from_a_region_over_http_serves_latent_calls_over_http(server):
    with _connect(server) as conn, server.client() as c:
        region = ClientRegion(conn, 1 << 20)
        laid = Laid(region, [5, 40, 0], [60, 40, 7], seed=1)
        w = laid.tensors["w_kv_b"].clone()
        before = _held(c)
        body = rr.encode({"w_kv_b": laid.places["w_kv_b"]})
        entry = c.put("/weights/layer0", content=body, headers=A | REGION_JSON)
        assert entry.status_code == 200, entry.text
        assert entry.json() == {
            "name": "layer0", "shape": list(w.shape), "dtype": "bfloat16", "bytes": w.nbytes
        }  # fmt: skip
        # charged to its caller: the copy and the JSON it was named by
        assert _held(c) == before + w.nbytes + len(body)
        # the client's region is its own: written after, the service's copy stands
        laid.tensors["w_kv_b"].zero_()
        meta = {"weight": "layer0", "return_lse": "true"}
        answer = c.post(
            "/prefill", content=rr.encode(laid.request(), meta), headers=A | REGION_JSON
        )
        assert answer.status_code == 200, answer.text
        assert rr.decode(answer.content, frozenset({"out", "lse"})).metadata["kernel"] == "latent"
        laid.check(w)
        # another tenant's names answer as never registered
        refused = c.post(
            "/prefill", content=rr.encode(laid.request(), meta), headers=B | REGION_JSON
        )
        assert refused.status_code == 404 and "__metadata__.weight" in refused.text
        assert c.delete("/weights/layer0", headers=A).status_code == 204
        assert _held(c) == before


def test_a_weight_from_a_region_on_the_socket_serves_latent_calls_there(server):
    with _connect(server) as conn, server.client() as c:
        region = ClientRegion(conn, 1 << 20)
        laid = Laid(region, [9, 33], [70, 33], seed=2)
        w = laid.tensors["w_kv_b"].clone()
        before = _held(c)
        entry = conn.weight("layer1", laid.places["w_kv_b"])
        assert entry == {
            "name": "layer1", "shape": list(w.shape), "dtype": "bfloat16", "bytes": w.nbytes
        }  # fmt: skip
        assert _held(c) > before + w.nbytes and "layer1" in _names(c, A)
        for form in ("expand", "absorb", "auto"):
            laid.tensors["out"].zero_()
            meta = {"weight": "layer1", "return_lse": "true", "form": form}
            reply = _socket_call(conn, laid.request(), meta)
            assert reply["ok"] is True, reply
            laid.check(w)
        # the tenant's weight, whichever way in: a regions JSON over HTTP names it too
        laid.tensors["out"].zero_()
        meta = {"weight": "layer1", "return_lse": "true"}
        answer = c.post(
            "/prefill", content=rr.encode(laid.request(), meta), headers=A | REGION_JSON
        )
        assert answer.status_code == 200, answer.text
        laid.check(w)
        conn.forget("layer1")
        assert "layer1" not in _names(c, A) and _held(c) == before
        reply = _socket_call(conn, laid.request(), meta)
        assert reply["status"] == 404 and "no weight named 'layer1'" in reply["error"], reply


@pytest.mark.parametrize(
    ("change", "status", "says"),
    [
        ({"offset": 1 << 20}, 422, "inside its region"),
        ({"dtype": "I32"}, 422, "w_kv_b.dtype"),
        ({"shape": (H * (NOPE + DV) * RANK,)}, 422, "kv_lora_rank"),
        ({"shape": (1 << 12, 1 << 9)}, 413, "--max-weight-bytes"),
        ({"region": "not-a-handle"}, 422, "a registered region handle"),
    ],
    ids=["past_its_region", "int_weight", "one_dim", "over_max_weight_bytes", "unknown_region"],
)
def test_a_bad_weight_place_is_refused_on_both_ways_in_and_registers_nothing(
    server, change, status, says
):
    with _connect(server) as conn, server.client() as c:
        region = ClientRegion(conn, 1 << 20)
        laid = Laid(region, [3], [9], seed=3)
        before = _held(c)
        bad = dataclasses.replace(laid.places["w_kv_b"], **change)
        answer = c.put("/weights/bad", content=rr.encode({"w_kv_b": bad}), headers=A | REGION_JSON)
        assert answer.status_code == status, answer.text
        assert says in answer.text
        with pytest.raises(ZenMLAError) as refused:
            conn.weight("bad", bad)
        assert says in str(refused.value)
        assert "bad" not in _names(c, A) and _held(c) == before
        assert c.get("/health").json()["status"] == "ok"


def test_a_latent_region_request_without_its_weight_is_refused_naming_it(server):
    with _connect(server) as conn:
        region = ClientRegion(conn, 1 << 20)
        laid = Laid(region, [3], [9], seed=4)
        reply = _socket_call(conn, laid.request(), {"return_lse": "true"})
        assert reply["status"] == 422 and reply["tensor"] == "__metadata__.weight", reply
        with pytest.raises(ZenMLAError, match="no weight named 'never'"):
            conn.forget("never")


def _counted(c, route: str) -> float:
    """`zen_mla_requests_total` for `route`'s 200s, from /metrics."""
    pattern = re.compile(rf'^zen_mla_requests_total\{{route="{route}",status="200"\}} (\S+)$')
    for line in c.get("/metrics").text.splitlines():
        if m := pattern.match(line):
            return float(m.group(1))
    return 0.0


def _reaches(c, route: str, count: float) -> None:
    """`route`'s 200s reach `count` (a worker writes a socket call's reply before the service
    counts it)."""
    wait_for(lambda: _counted(c, route) >= count, 10, lambda: f"{route}: {_counted(c, route)}")
    assert _counted(c, route) == count


def test_the_clients_take_the_region_socket_for_latent_calls(server):
    """With shared memory, `prefill_latent` registers its weight on the region socket from a
    region and calls there (no body over HTTP), both twins; a weight forgotten behind the
    client's back is registered again; `forget_weight` forgets it there."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(H * (NOPE + DV), RANK, generator=gen) / RANK**0.5).bfloat16()
    q = torch.randn(37, H, NOPE + ROPE, generator=gen).bfloat16()
    kv_c = torch.randn(100, RANK, generator=gen).bfloat16()
    k_pe = torch.randn(100, ROPE, generator=gen).bfloat16()
    q_cu, kv_cu = torch.tensor([0, 7, 37]).int(), torch.tensor([0, 70, 100]).int()
    want, want_lse = latent_attention(q, kv_c, k_pe, w, q_cu, kv_cu, return_lse=True)
    args = (q, kv_c, k_pe, "client-w", q_cu, kv_cu)
    with server.client() as c:
        calls, weights = _counted(c, "socket"), _counted(c, "weights")
        with PrefillClient(server.url, token="token-a", shared_memory=True) as client:
            client.register_weight("client-w", w)
            for _ in range(2):
                out, lse = client.prefill_latent(*args, return_lse=True)
                assert (out.float() - want.float()).abs().max().item() <= 2**-6
                assert (lse - want_lse).abs().max().item() <= 1e-4
            _reaches(c, "socket", calls + 2)
            _reaches(c, "weights", weights + 1)
            assert "client-w" in _names(c, A)
            assert c.delete("/weights/client-w", headers=A).status_code == 204
            out = client.prefill_latent(*args, form="absorb")
            assert (out.float() - want.float()).abs().max().item() <= 2**-6
            assert "client-w" in _names(c, A) and _counted(c, "weights") == weights + 2
            client.forget_weight("client-w")
            assert "client-w" not in _names(c, A)

        async def over_asyncio() -> None:
            async with AsyncPrefillClient(server.url, token="token-a", shared_memory=True) as a:
                a.register_weight("async-w", w)
                got = await a.prefill_latent(*args[:3], "async-w", q_cu, kv_cu, form="expand")
                assert (got.float() - want.float()).abs().max().item() <= 2**-6
                assert "async-w" in _names(c, A)
                await a.forget_weight("async-w")

        calls = _counted(c, "socket")
        asyncio.run(over_asyncio())
        _reaches(c, "socket", calls + 1)
        assert "async-w" not in _names(c, A)


def test_a_weight_registered_on_a_connection_ends_with_it(server):
    """As a region does: the connection closed, its weight is forgotten and its charge back; one
    of the same caller's registered over HTTP stays."""
    with server.client() as c:
        before = _held(c)
        conn = RegionConnection(region_socket(server), "token-a")
        try:
            region = ClientRegion(conn, 1 << 20)
            laid = Laid(region, [3], [9], seed=6)
            conn.weight("on-socket", laid.places["w_kv_b"])
            body = rr.encode({"w_kv_b": laid.places["w_kv_b"]})
            put = c.put("/weights/over-http", content=body, headers=A | REGION_JSON)
            assert put.status_code == 200, put.text
            assert {"on-socket", "over-http"} <= set(_names(c, A))
        finally:
            conn.close()
        wait_for(lambda: "on-socket" not in _names(c, A), 10, lambda: str(_names(c, A)))
        assert "over-http" in _names(c, A)
        assert c.delete("/weights/over-http", headers=A).status_code == 204
        assert _held(c) == before


def test_a_weight_frame_whose_connection_closes_at_once_leaves_nothing(server):
    """The frame sent, the connection closed before any answer: whichever comes first to the
    service, no weight outlives the connection, nothing stays charged."""
    with server.client() as c:
        before = _held(c)
        for i in range(5):
            conn = RegionConnection(region_socket(server), "token-a")
            region = ClientRegion(conn, 1 << 20)
            laid = Laid(region, [3], [9], seed=7)
            body = rr.encode({"w_kv_b": laid.places["w_kv_b"]}).decode()
            send_frame(conn._sock, {"op": "weight", "name": f"gone-{i}", "body": body})
            conn.close()
        wait_for(lambda: _held(c) == before, 10, lambda: f"{_held(c)} held, {before} before")
        assert not [n for n in _names(c, A) if n.startswith("gone-")]
