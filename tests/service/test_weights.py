"""Weights registered once (`PUT /weights/{name}`) and named by `/prefill` calls over MLA's latent
cache, on a real `zen-mla serve` with tenants: each answer equal to in-process
`latent_attention`; a weight charged to its tenant while registered and given back when
forgotten or replaced; another tenant's names answer as never registered; bad registrations and
bad latent calls refused naming what is wrong, the service healthy after; a registration that
falls silent cut by the body reader; a weight forgotten while calls use it stays until they
end."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

import zen_mla
from bench._server import free_port
from tests.service.grpc_caller import grpc_inputs
from tests.service.raw import address, assert_problem, read_answer
from tests.service.servers import busy_worker, serve, server_fixture
from tests.service.v2_tensors import to_numpy, to_torch
from zen_mla import wire
from zen_mla.attention.latent import latent_attention
from zen_mla.client import AsyncPrefillClient, PrefillClient

H, RANK, ROPE, NOPE, DV = 4, 64, 16, 32, 32
A = {"Authorization": "Bearer token-a"}
B = {"Authorization": "Bearer token-b"}
OCTETS = {"Content-Type": "application/octet-stream"}


def _body(tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> bytes:
    header, chunks = wire.encode(tensors, meta)
    return header + b"".join(bytes(c) for c in chunks)


def _weight(seed: int = 0, rank: int = RANK) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(H * (NOPE + DV), rank, generator=gen) / rank**0.5).bfloat16()


def _latent(q_lens: list[int], kv_lens: list[int], seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(q_lens), sum(kv_lens)
    return {
        "q": torch.randn(tq, H, NOPE + ROPE, generator=gen).bfloat16(),
        "kv_c": torch.randn(tk, RANK, generator=gen).bfloat16(),
        "k_pe": torch.randn(tk, ROPE, generator=gen).bfloat16(),
        "q_cu_seq_lens": torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]).int(),
        "kv_cu_seq_lens": torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()]).int(),
    }


def _register(c: httpx.Client, name: str, w: torch.Tensor, auth: dict) -> httpx.Response:
    return c.put(f"/weights/{name}", content=_body({"w_kv_b": w}), headers=auth | OCTETS)


def _call(c: httpx.Client, x: dict, weight: str, auth: dict, **meta: str) -> httpx.Response:
    meta = {"weight": weight, "return_lse": "true"} | meta
    return c.post("/prefill", content=_body(x, meta), headers=auth | OCTETS)


def _decoded(answer: httpx.Response, names: set[str]) -> tuple[dict, dict]:
    raw = torch.frombuffer(bytearray(answer.content), dtype=torch.uint8)
    return wire.decode(raw, frozenset(names))


def _held(c: httpx.Client) -> int:
    return int(c.get("/health").json()["held_bytes"]["weight"])


@server_fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp: Path = tmp_path_factory.mktemp("weights")
    tenants = tmp / "tenants"
    tenants.write_text("team-a token-a\nteam-b token-b\n")
    with serve(
        tmp,
        workers=2,
        tenants_file=str(tenants),
        max_weights=3,
        max_weight_bytes=1 << 20,
        grpc_port=free_port(),
    ) as s:
        yield s


@pytest.mark.parametrize("form", ["expand", "absorb", "auto"])
def test_a_latent_call_names_a_registered_weight(server, form):
    w, x = _weight(), _latent([5, 40, 0], [60, 40, 7])
    with server.client() as c:
        entry = _register(c, "layer0", w, A)
        assert entry.status_code == 200, entry.text
        assert entry.json() == {
            "name": "layer0",
            "shape": [H * (NOPE + DV), RANK],
            "dtype": "bfloat16",
            "bytes": w.nbytes,
        }
        answer = _call(c, x, "layer0", A, form=form)
        assert answer.status_code == 200, answer.text
        got, meta = _decoded(answer, {"out", "lse"})
        assert meta["kernel"] == meta["lse_kernel"] == "latent"
        want, want_lse = latent_attention(
            x["q"], x["kv_c"], x["k_pe"], w, x["q_cu_seq_lens"], x["kv_cu_seq_lens"],
            return_lse=True, form=form,
        )  # fmt: skip
        assert (got["out"].float() - want.float()).abs().max().item() <= 2**-6
        assert (got["lse"] - want_lse).abs().max().item() <= 1e-4


def test_a_latent_call_is_computed_in_the_precision_it_asks(server):
    """`__metadata__.precision` reaches the kernel: the LSE as in-process `latent_attention`
    gives it in that precision (bf16's rounding moves it ~1e-3 where the CPU has bf16
    arithmetic); one the library has not is refused naming it."""
    w, x = _weight(seed=8), _latent([7, 30], [50, 30])
    args = (x["q"], x["kv_c"], x["k_pe"], w, x["q_cu_seq_lens"], x["kv_cu_seq_lens"])
    with server.client() as c:
        assert _register(c, "exact", w, A).status_code == 200
        try:
            for precision in ("bf16", "fp32"):
                answer = _call(c, x, "exact", A, form="expand", precision=precision)
                assert answer.status_code == 200, answer.text
                got, _ = _decoded(answer, {"out", "lse"})
                want, want_lse = latent_attention(
                    *args, return_lse=True, form="expand", precision=precision
                )
                assert (got["out"].float() - want.float()).abs().max().item() <= 2**-6
                assert (got["lse"] - want_lse).abs().max().item() <= 1e-5
            refused = _call(c, x, "exact", A, precision="fp8")
            assert refused.status_code == 422
            assert refused.json()["tensor"] == "precision" and "bf16" in refused.text
        finally:
            c.delete("/weights/exact", headers=A)


def test_a_weight_is_charged_until_forgotten_and_its_tenants_alone(server):
    w = _weight(seed=2)
    with server.client() as c:
        before = _held(c)
        assert _register(c, "mine", w, A).status_code == 200
        assert _held(c) == before + w.nbytes + 8 + _header_bytes(w)
        names = [e["name"] for e in c.get("/weights", headers=A).json()]
        assert "mine" in names
        assert "mine" not in [e["name"] for e in c.get("/weights", headers=B).json()]
        # another tenant's name answers as never registered: for a call and a forget
        refused = _call(c, _latent([3], [9]), "mine", B)
        assert refused.status_code == 404 and "__metadata__.weight" in refused.text
        assert c.delete("/weights/mine", headers=B).status_code == 404
        assert _call(c, _latent([3], [9]), "mine", A).status_code == 200
        # registered again under its name: the old one let go, the new one charged
        assert _register(c, "mine", w, A).status_code == 200
        assert _held(c) == before + w.nbytes + 8 + _header_bytes(w)
        assert c.delete("/weights/mine", headers=A).status_code == 204
        assert _held(c) == before
        assert c.delete("/weights/mine", headers=A).status_code == 404


def _header_bytes(w: torch.Tensor) -> int:
    header, _ = wire.encode({"w_kv_b": w})
    return len(header) - 8


@pytest.mark.parametrize(
    ("send", "status", "says"),
    [
        (lambda c: _register(c, "bad name!", _weight(), A), 422, "A-Z a-z 0-9"),
        (lambda c: _register(c, "w", _weight()[0], A), 422, "w_kv_b"),
        (lambda c: _register(c, "w", _weight().to(torch.int32), A), 422, "w_kv_b"),
        (
            lambda c: c.put("/weights/w", content=_body({"q": _weight()}), headers=A | OCTETS),
            422,
            "q",
        ),
        (lambda c: c.put("/weights/w", content=b"{}", headers=A | OCTETS), 400, ""),
        (lambda c: _register(c, "w", _weight(), {}), 401, ""),
        (lambda c: _register(c, "w", torch.zeros(1024, 1024, dtype=torch.bfloat16), A), 413, ""),
        (lambda c: _call(c, _latent([3], [9]), "nowhere", A), 404, "nowhere"),
        (
            lambda c: c.post("/prefill", content=_body(_latent([3], [9]), {}), headers=A | OCTETS),
            422,
            "__metadata__.weight",
        ),
    ],
    ids=[
        "bad_name",
        "one_dim",
        "int_weight",
        "another_tensor",
        "not_safetensors",
        "no_token",
        "over_max_weight_bytes",
        "unknown_weight",
        "latent_without_weight",
    ],
)
def test_a_bad_registration_or_call_is_refused_and_the_service_stays_well(
    server, send, status, says
):
    with server.client() as c:
        answer = send(c)
        assert answer.status_code == status, answer.text
        assert says in answer.text
        assert c.get("/health").json()["status"] == "ok"
        assert "w" not in [e["name"] for e in c.get("/weights", headers=A).json()]


def test_a_weight_of_another_shape_than_the_call_is_refused_naming_it(server):
    with server.client() as c:
        assert _register(c, "wide", _weight(rank=RANK + 8), A).status_code == 200
        try:
            answer = _call(c, _latent([3], [9]), "wide", A)
            assert answer.status_code == 422 and "w_kv_b" in answer.text
            assert "the rank of kv_c" in answer.text
        finally:
            c.delete("/weights/wide", headers=A)


def test_at_most_max_weights_a_tenant_and_room_again_once_forgotten(server):
    with server.client() as c:
        before = _held(c)
        for name in ("w1", "w2", "w3"):
            assert _register(c, name, _weight(), B).status_code == 200
        over = _register(c, "w4", _weight(), B)
        assert over.status_code == 422 and "at most 3 weights" in over.text
        assert _register(c, "w1", _weight(seed=5), B).status_code == 200  # replaced: no more
        assert _register(c, "w4", _weight(), A).status_code == 200  # another tenant's room
        for name in ("w1", "w2", "w3"):
            assert c.delete(f"/weights/{name}", headers=B).status_code == 204
        assert c.delete("/weights/w4", headers=A).status_code == 204
        assert _held(c) == before


def test_a_weight_forgotten_while_calls_use_it_stays_until_they_end(server):
    """Calls keep coming while the weight is forgotten: each is answered right (it was leased
    before the forget) or 404 (after); the weight's charge goes back once the last ends."""
    w, x = _weight(seed=3), _latent([256], [8192])
    want = latent_attention(
        x["q"], x["kv_c"], x["k_pe"], w, x["q_cu_seq_lens"], x["kv_cu_seq_lens"]
    )
    with server.client() as c:
        before = _held(c)
        assert _register(c, "busy", w, A).status_code == 200

        def call() -> int:
            with server.client() as own:
                answer = _call(own, x, "busy", A, return_lse="false")
                if answer.status_code == 200:
                    got, _ = _decoded(answer, {"out"})
                    assert (got["out"].float() - want.float()).abs().max().item() <= 2**-6
                return answer.status_code

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(call) for _ in range(8)]
            busy_worker(server)  # a call holds its lease: forgotten under it
            assert c.delete("/weights/busy", headers=A).status_code == 204
            codes = [f.result() for f in calls]
        assert set(codes) <= {200, 404} and codes.count(200) >= 1
        assert _held(c) == before
        assert c.get("/health").json()["status"] == "ok"


def test_the_clients_register_once_call_and_register_again_where_the_service_forgot(server):
    """`register_weight` sends nothing; the first call registers it, later ones do not; a
    weight the service no longer holds (forgotten behind the client's back, as a restart
    would) is registered again and the call answered; `forget_weight` forgets it there."""
    w, x = _weight(seed=4), _latent([7, 30], [90, 30])
    want, want_lse = latent_attention(
        x["q"], x["kv_c"], x["k_pe"], w, x["q_cu_seq_lens"], x["kv_cu_seq_lens"],
        return_lse=True,
    )  # fmt: skip
    args = (x["q"], x["kv_c"], x["k_pe"], "client-w", x["q_cu_seq_lens"], x["kv_cu_seq_lens"])
    with server.client() as c, PrefillClient(server.url, token="token-a") as client:
        client.register_weight("client-w", w)
        assert "client-w" not in [e["name"] for e in c.get("/weights", headers=A).json()]
        for _ in range(2):
            out, lse = client.prefill_latent(*args, return_lse=True)
            assert (out.float() - want.float()).abs().max().item() <= 2**-6
            assert (lse - want_lse).abs().max().item() <= 1e-4
        assert c.delete("/weights/client-w", headers=A).status_code == 204
        out = client.prefill_latent(*args, form="absorb")
        assert (out.float() - want.float()).abs().max().item() <= 2**-6
        assert "client-w" in [e["name"] for e in c.get("/weights", headers=A).json()]
        client.forget_weight("client-w")
        assert "client-w" not in [e["name"] for e in c.get("/weights", headers=A).json()]
        with pytest.raises(zen_mla.InvalidInputError, match="weight"):
            client.prefill_latent(*args)

    _, want_bf16 = latent_attention(
        x["q"], x["kv_c"], x["k_pe"], w, x["q_cu_seq_lens"], x["kv_cu_seq_lens"],
        return_lse=True, form="expand", precision="bf16",
    )  # fmt: skip

    async def over_asyncio() -> None:
        async with AsyncPrefillClient(server.url, token="token-b") as aclient:
            aclient.register_weight("client-w", w)
            got = await aclient.prefill_latent(*args, form="expand")
            assert (got.float() - want.float()).abs().max().item() <= 2**-6
            _, lse = await aclient.prefill_latent(
                *args, return_lse=True, form="expand", precision="bf16"
            )
            assert (lse - want_bf16).abs().max().item() <= 1e-5
            await aclient.forget_weight("client-w")

    asyncio.run(over_asyncio())
    with server.client() as c:
        assert "client-w" not in [e["name"] for e in c.get("/weights", headers=B).json()]


def test_the_v2_routes_take_the_latent_and_name_the_weight(server):
    """KServe v2 over HTTP and gRPC (tritonclient): inputs kv_c and k_pe in place of k and v,
    the `weight` parameter naming a registered one, `form` (and over gRPC `precision`) passed
    on; answers equal to in-process `latent_attention`; a latent request with no weight refused
    naming it."""
    w, x = _weight(seed=6), _latent([9, 33], [70, 33])
    want, want_lse = latent_attention(
        x["q"], x["kv_c"], x["k_pe"], w, x["q_cu_seq_lens"], x["kv_cu_seq_lens"],
        return_lse=True, form="absorb",
    )  # fmt: skip
    params = {"weight": "v2-w", "form": "absorb", "return_lse": True}

    def token() -> dict[str, str]:  # tritonclient.http writes its own headers into the dict
        return {"authorization": "Bearer token-a"}

    with server.client() as c:
        assert _register(c, "v2-w", w, A).status_code == 200
        try:
            with triton_http.InferenceServerClient(server.url.removeprefix("http://")) as v2:
                inputs = []
                for name, t in x.items():
                    a = to_numpy(t)
                    i = triton_http.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
                    i.set_data_from_numpy(a, binary_data=True)
                    inputs.append(i)
                got = v2.infer("mla_prefill", inputs, parameters=params, headers=token())
                out, lse = to_torch(got.as_numpy("out")), to_torch(got.as_numpy("lse"))
                assert (out.float() - want.float()).abs().max().item() <= 2**-6
                assert (lse - want_lse).abs().max().item() <= 1e-4
                with pytest.raises(InferenceServerException, match=r"parameters\.weight"):
                    v2.infer("mla_prefill", inputs, parameters={"form": "expand"}, headers=token())
            with triton_grpc.InferenceServerClient(server.grpc_target) as g:
                got = g.infer("mla_prefill", grpc_inputs(x), parameters=params, headers=token())
                out, lse = to_torch(got.as_numpy("out")), to_torch(got.as_numpy("lse"))
                assert (out.float() - want.float()).abs().max().item() <= 2**-6
                assert (lse - want_lse).abs().max().item() <= 1e-4
                bf16 = params | {"precision": "bf16"}
                got = g.infer("mla_prefill", grpc_inputs(x), parameters=bf16, headers=token())
                _, want_bf16 = latent_attention(
                    x["q"], x["kv_c"], x["k_pe"], w, x["q_cu_seq_lens"], x["kv_cu_seq_lens"],
                    return_lse=True, form="absorb", precision="bf16",
                )  # fmt: skip
                assert (to_torch(got.as_numpy("lse")) - want_bf16).abs().max().item() <= 1e-5
                with pytest.raises(InferenceServerException, match="no weight named 'other'"):
                    other = params | {"weight": "other"}
                    g.infer("mla_prefill", grpc_inputs(x), parameters=other, headers=token())
        finally:
            assert c.delete("/weights/v2-w", headers=A).status_code == 204


@pytest.mark.slow
def test_weights_of_every_caller_hold_at_most_half_the_byte_budget(tmp_path):
    """Weights from many callers (peer addresses without tenants) cannot squat the budget:
    past half of it a registration is 429 and the service still computes; forgetting makes
    room again."""
    w = torch.zeros(H * (NOPE + DV), 1200, dtype=torch.bfloat16)  # 600 KiB
    budget = {"max_inflight_bytes": 2 << 20, "max_body_bytes": 1 << 20}
    with serve(tmp_path, workers=1, **budget) as s, s.client() as c:
        assert _register(c, "a", w, {}).status_code == 200
        refused = _register(c, "b", w, {})
        assert refused.status_code == 429 and "half of --max-inflight-bytes" in refused.text
        assert refused.headers["retry-after"] == "5"
        x = _latent([3], [9])
        small = _weight()
        assert c.delete("/weights/a").status_code == 204
        assert _register(c, "b", w, {}).status_code == 200
        assert _register(c, "small", small, {}).status_code == 200
        answer = _call(c, x, "small", {})
        assert answer.status_code == 200, answer.text


def test_a_registration_that_trickles_or_falls_silent_is_cut_and_registers_nothing(server):
    """`PUT /weights/{name}` is read by the one body reader: a body announced at 512 KiB that
    sends 100 bytes and then nothing is cut with 408 once the grace is over (under the minimum
    rate), nothing is registered or left charged, and the service answers meanwhile."""
    with server.client() as c:
        before = _held(c)
        with socket.create_connection(address(server)) as s:
            head = (
                b"PUT /weights/silent HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer token-a\r\n"
                b"Content-Type: application/octet-stream\r\nContent-Length: 524288\r\n\r\n"
            )
            s.sendall(head + b"\0" * 100)
            assert c.get("/health").json()["status"] == "ok"  # served while it waits
            started = time.monotonic()
            raw = read_answer(s, 15)
        assert_problem(raw, 408)
        assert time.monotonic() - started < 10
        assert "silent" not in [e["name"] for e in c.get("/weights", headers=A).json()]
        assert _held(c) == before
