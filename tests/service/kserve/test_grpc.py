"""The Open Inference Protocol over gRPC on real servers, driven by the real Triton client
(`tritonclient.grpc`) and by `grpc.aio` with the protocol's messages: every method served, raw
bf16/fp16/fp32 tensors and typed contents against the references, the LSE, system shared memory
both ways, and each error as its gRPC status with the message HTTP gives, the service healthy
after each."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
import numpy as np
import pytest
import torch
from tritonclient.grpc import (
    InferenceServerClient,
    InferenceServerException,
    InferInput,
    InferRequestedOutput,
    service_pb2_grpc,
)
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import shared_memory as shm

import zen_mla
from bench._server import free_port
from tests.batches import BATCH_SPECS, make_batch
from tests.reference import assert_close_to_reference
from tests.service.grpc_caller import grpc_inputs
from tests.service.servers import Server, serve, server_fixture
from tests.service.v2_tensors import to_torch
from zen_mla import __version__

pytestmark = pytest.mark.slow

MODEL = "mla_prefill"
MLA = (2, 192, 128)


@server_fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(
        tmp_path_factory.mktemp("grpc"),
        grpc_port=free_port(),
        system_shm=True,
        workers=min(2, len(os.sched_getaffinity(0))),
        max_body_bytes=64 << 20,
    ) as s:
        yield s


@server_fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """System shared memory off, a token required."""
    with serve(
        tmp_path_factory.mktemp("grpc_plain"), grpc_port=free_port(), workers=1, api_token="s3cret"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[InferenceServerClient]:
    with InferenceServerClient(server.grpc_target) as c:
        yield c


def _batch(dtype=torch.bfloat16, spec="ragged"):
    return make_batch(BATCH_SPECS[spec], MLA, dtype)


def _tensors(q, k, v, q_cu, kv_cu=None) -> dict[str, torch.Tensor]:
    named = {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}
    if kv_cu is not None:
        named["kv_cu_seq_lens"] = kv_cu
    return named


def _refused(call, code: str, *fragments: str) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == f"StatusCode.{code}", (info.value.status(), info.value)
    message = str(info.value.message())
    for part in fragments:
        assert part in message, (part, message)
    return message


def _healthy(server: Server, client: InferenceServerClient, headers=None) -> None:
    assert server.health()["status"] == "ok"
    q, k, v, q_cu, _ = _batch()
    result = client.infer(MODEL, grpc_inputs(_tensors(q, k, v, q_cu)), headers=headers)
    assert_close_to_reference(q, k, v, q_cu, None, True, to_torch(result.as_numpy("out")))


# -- every method -------------------------------------------------------------------------------


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    meta = client.get_server_metadata()
    assert meta.name == "zen-mla" and meta.version == __version__
    assert "system_shared_memory" in meta.extensions
    model = client.get_model_metadata(MODEL)
    assert model.name == MODEL and list(model.versions) == ["1"]
    assert [i.name for i in model.inputs] == [
        "q", "k", "v", "kv_c", "k_pe", "q_cu_seq_lens", "kv_cu_seq_lens"
    ]  # fmt: skip
    assert [(o.name, o.datatype) for o in model.outputs] == [("out", "BF16"), ("lse", "FP32")]
    _refused(lambda: client.get_model_metadata("nope"), "NOT_FOUND", "no model named 'nope'")
    _refused(lambda: client.is_model_ready(MODEL, "2"), "NOT_FOUND", "version 1 only")
    _refused(lambda: client.get_model_config(MODEL), "UNIMPLEMENTED")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("return_lse", [False, True])
def test_raw_tensors_match_the_reference_and_the_library(client, dtype, causal, return_lse):
    q, k, v, q_cu, _ = _batch(dtype, "ragged")
    params = {"causal": causal, "return_lse": return_lse}
    result = client.infer(MODEL, grpc_inputs(_tensors(q, k, v, q_cu)), parameters=params)
    out = to_torch(result.as_numpy("out"))
    lse = result.as_numpy("lse")
    assert (lse is not None) == return_lse
    lse_t = None if lse is None else to_torch(lse)
    assert_close_to_reference(q, k, v, q_cu, None, causal, out, lse_t)
    want = zen_mla.ragged_attention(q, k, v, q_cu, causal=causal, return_lse=return_lse)
    got = (out, lse_t) if return_lse else out
    if return_lse:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    else:
        assert torch.equal(got, want)
    kernels = result.get_response().parameters
    assert kernels["kernel"].string_param


def test_kv_cu_seq_lens_and_named_outputs(client):
    q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS["ragged"], MLA, torch.bfloat16)
    kv_cu = q_cu.to(torch.int64)
    outputs = [InferRequestedOutput("lse"), InferRequestedOutput("out")]
    result = client.infer(
        MODEL,
        grpc_inputs(_tensors(q, k, v, q_cu, kv_cu)),
        outputs=outputs,
        parameters={"return_lse": True},
        request_id="call-7",
    )
    assert result.get_response().id == "call-7"
    assert [o.name for o in result.get_response().outputs] == ["lse", "out"]
    out, lse = to_torch(result.as_numpy("out")), to_torch(result.as_numpy("lse"))
    assert_close_to_reference(q, k, v, q_cu, kv_cu, True, out, lse)


def _stub_call(target: str, request: pb.ModelInferRequest, metadata=()):
    async def call():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            return await stub.ModelInfer(request, metadata=metadata, timeout=60)

    return asyncio.run(call())


def test_grpc_aio_with_typed_contents(server):
    """fp32 q/k/v as fp32_contents and cu_seq_lens as int_contents: no raw bytes at all."""
    q, k, v, q_cu, _ = _batch(torch.float32, "single")
    request = pb.ModelInferRequest(model_name=MODEL)
    for name, t in _tensors(q, k, v, q_cu).items():
        tensor = request.inputs.add(
            name=name, datatype="FP32" if t.is_floating_point() else "INT32"
        )
        tensor.shape.extend(t.shape)
        if t.is_floating_point():
            tensor.contents.fp32_contents.extend(t.reshape(-1).tolist())
        else:
            tensor.contents.int_contents.extend(t.tolist())
    response = _stub_call(server.grpc_target, request)
    (out,) = response.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("out", "FP32", [37, 2, 128])
    got = torch.from_numpy(np.frombuffer(response.raw_output_contents[0], np.float32).copy())
    want = zen_mla.ragged_attention(q, k, v, q_cu)
    assert torch.equal(got.view(want.shape), want)


def test_shared_memory_in_and_out(client):
    q, k, v, q_cu, _ = _batch(torch.bfloat16)
    arrays = {
        n: t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        for n, t in _tensors(q, k, v, q_cu).items()
    }
    size_in = sum(a.nbytes for a in arrays.values())
    out_bytes = q.shape[0] * MLA[0] * MLA[2] * 2
    key = f"/zen-mla-grpc-{os.getpid()}"
    handle = shm.create_shared_memory_region("grpc_io", key, size_in + out_bytes + 4096)
    try:
        client.register_system_shared_memory("grpc_io", key, size_in + out_bytes + 4096)
        status = client.get_system_shared_memory_status()
        assert "grpc_io" in status.regions and status.regions["grpc_io"].key == key
        inputs, at = [], 0
        for name, a in arrays.items():
            shm.set_shared_memory_region(handle, [a], offset=at)
            datatype = "BF16" if name in ("q", "k", "v") else "INT32"
            i = InferInput(name, list(a.shape), datatype)
            i.set_shared_memory("grpc_io", a.nbytes, offset=at)
            inputs.append(i)
            at += a.nbytes
        out = InferRequestedOutput("out")
        out.set_shared_memory("grpc_io", out_bytes, offset=size_in)
        result = client.infer(MODEL, inputs, outputs=[out])
        entry = result.get_output("out")
        assert entry.parameters["shared_memory_region"].string_param == "grpc_io"
        raw = shm.get_contents_as_numpy(
            handle, np.int16, [q.shape[0], MLA[0], MLA[2]], offset=size_in
        )
        got = torch.from_numpy(raw.copy()).view(torch.bfloat16)
        assert torch.equal(got, zen_mla.ragged_attention(q, k, v, q_cu))
    finally:
        client.unregister_system_shared_memory()
        assert not client.get_system_shared_memory_status().regions
        shm.destroy_shared_memory_region(handle)


# -- errors -------------------------------------------------------------------------------------


def test_bad_requests_are_invalid_argument_naming_the_tensor(server, client):
    q, k, v, q_cu, _ = _batch()
    named = _tensors(q, k, v, q_cu)
    no_k = {n: t for n, t in named.items() if n != "k"}
    _refused(lambda: client.infer(MODEL, grpc_inputs(no_k)), "INVALID_ARGUMENT", "k: expected")
    bad_cu = dict(named, q_cu_seq_lens=torch.tensor([0, 5, 3], dtype=torch.int32))
    _refused(lambda: client.infer(MODEL, grpc_inputs(bad_cu)), "INVALID_ARGUMENT", "q_cu_seq_lens")
    three_heads = dict(named, k=torch.zeros(k.shape[0], 3, 192, dtype=torch.bfloat16))
    _refused(lambda: client.infer(MODEL, grpc_inputs(three_heads)), "INVALID_ARGUMENT", "k")
    _refused(
        lambda: client.infer(MODEL, grpc_inputs(named), parameters={"kernel": "nope"}),
        "INVALID_ARGUMENT",
        "kernel",
    )
    _refused(lambda: client.infer("nope", grpc_inputs(named)), "NOT_FOUND")
    _healthy(server, client)


def test_raw_contents_that_do_not_add_up_and_broken_messages(server, client):
    q, k, v, q_cu, _ = _batch()
    request = pb.ModelInferRequest(model_name=MODEL)
    for name, t in _tensors(q, k, v, q_cu).items():
        request.inputs.add(
            name=name, datatype="BF16" if t.is_floating_point() else "INT32", shape=list(t.shape)
        )
    request.raw_input_contents.append(b"\0" * 8)  # one of four
    with pytest.raises(grpc.RpcError) as info:
        _stub_call(server.grpc_target, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents" in info.value.details()

    async def garbage():
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            return await call(b"\x0a\xff\xff\xff\xff\x0f", timeout=30)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(garbage())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "message" in info.value.details()
    _healthy(server, client)


def test_token_and_shared_memory_off(plain):
    with InferenceServerClient(plain.grpc_target) as c:
        q, k, v, q_cu, _ = _batch()
        inputs = grpc_inputs(_tensors(q, k, v, q_cu))
        assert c.is_server_ready()  # health and metadata need no token, as on HTTP
        _refused(lambda: c.infer(MODEL, inputs), "UNAUTHENTICATED", "bearer token")
        bad = {"authorization": "Bearer nope"}
        _refused(lambda: c.infer(MODEL, inputs, headers=bad), "UNAUTHENTICATED")
        good = {"authorization": "Bearer s3cret"}
        _refused(
            lambda: c.register_system_shared_memory("r", "/x", 64, headers=good),
            "PERMISSION_DENIED",
        )
        _healthy(plain, c, headers=good)


def test_a_message_over_the_limit_is_resource_exhausted_unread(server, client):
    big = torch.zeros((65 << 20) // (2 * 192 * 2), 2, 192, dtype=torch.bfloat16)
    q_cu = torch.tensor([0, big.shape[0]], dtype=torch.int32)
    inputs = grpc_inputs({"q": big, "k": big, "v": big[..., :128], "q_cu_seq_lens": q_cu})
    _refused(lambda: client.infer(MODEL, inputs), "RESOURCE_EXHAUSTED", "larger than max")
    _healthy(server, client)


def _readme_block(section: str) -> str:
    text = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text.split(section, 1)[1], re.S)
    assert block is not None, f"no python block under {section}"
    return block.group(1)


def test_the_readme_v2_example_runs_over_http_and_over_grpc(server):
    """The README's v2 example as written (its tensors from the library example above it),
    then with the module and the URL changed, and nothing else: the same answer."""
    scope: dict[str, Any] = {}
    exec(compile(_readme_block("## The library"), "README.md", "exec"), scope)
    example = _readme_block("## KServe v2")
    assert "import tritonclient.http as triton" in example and "127.0.0.1:8000" in example
    http = urlparse(server.url).netloc
    grpc_example = example.replace("tritonclient.http", "tritonclient.grpc").replace(
        "127.0.0.1:8000", server.grpc_target
    )
    answers = []
    for code in (example.replace("127.0.0.1:8000", http), grpc_example):
        run = dict(scope)
        try:
            exec(compile(code, "README.md", "exec"), run)
        finally:
            if "client" in run:
                run["client"].close()  # the example leaves it to the end of the program
        answers.append((to_torch(run["out"]), to_torch(run["lse"])))
    (out_h, lse_h), (out_g, lse_g) = answers
    assert out_h.shape == (3072, scope["H"], 128) and lse_h.shape == (scope["H"], 3072)
    assert torch.equal(out_h, out_g) and torch.equal(lse_h, lse_g)
