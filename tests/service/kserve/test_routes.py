"""The Open Inference Protocol (KServe v2) routes on real servers, driven by the real Triton
client (`tritonclient.http`) and, where that client cannot go wrong enough, by raw HTTP:
metadata and health, binary and JSON tensors against the fp64 reference, the system shared
memory extension (and its refusals), every bad request a 4xx naming what is wrong that leaves
the service healthy, and the token."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import ml_dtypes
import numpy as np
import pytest
import torch
from tritonclient.http import (
    InferenceServerClient,
    InferenceServerException,
    InferInput,
    InferRequestedOutput,
    InferResult,
)
from tritonclient.utils import np_to_triton_dtype
from tritonclient.utils import shared_memory as shm

from tests.batches import BATCH_SPECS, EMPTY_SPECS, make_batch
from tests.reference import assert_close_to_reference
from tests.service.servers import Server, serve, server_fixture, wait_ready
from tests.service.v2_tensors import to_numpy, to_torch
from zen_mla import __version__

pytestmark = pytest.mark.slow

MODEL = "mla_prefill"
INFER = f"/v2/models/{MODEL}/infer"
MLA = (2, 192, 128)  # H, Dqk, Dv
TOKEN = {"Authorization": "Bearer s3cret"}
_KEYS = itertools.count()


# ---------------------------------------------------------------------------------------------
# servers and clients


def _triton(server: Server) -> InferenceServerClient:
    return InferenceServerClient(urlparse(server.url).netloc, network_timeout=120)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[InferenceServerClient]:
    """The package's server: system shared memory off (the default)."""
    with _triton(server) as c:
        yield c


@server_fixture(scope="module")
def shm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(
        tmp_path_factory.mktemp("kserve_shm"),
        system_shm=True,
        system_shm_max_regions=8,
        workers=min(2, len(os.sched_getaffinity(0))),
        max_body_bytes=64 << 20,
        max_work=1 << 36,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def shm_client(shm_server: Server) -> Iterator[InferenceServerClient]:
    with _triton(shm_server) as c:
        yield c


@server_fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("kserve_token"), workers=1, api_token="s3cret") as s:
        yield s


# ---------------------------------------------------------------------------------------------
# tensors: torch <-> numpy (BF16 as ml_dtypes.bfloat16) and requests


def _input(name: str, a: np.ndarray, binary: bool = True) -> InferInput:
    i = InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
    i.set_data_from_numpy(a, binary_data=binary)
    return i


def _arrays(q, k, v, q_cu, kv_cu=None) -> list[tuple[str, np.ndarray]]:
    named = [("q", q), ("k", k), ("v", v), ("q_cu_seq_lens", q_cu)]
    if kv_cu is not None:
        named.append(("kv_cu_seq_lens", kv_cu))
    return [(n, to_numpy(t)) for n, t in named]


def _infer(
    client: InferenceServerClient, arrays, *, binary: bool = True, outputs=None, **kwargs
) -> InferResult:
    inputs = [_input(n, a, binary) for n, a in arrays]
    params = kwargs.pop("parameters", None)
    return client.infer(MODEL, inputs, outputs=outputs, parameters=params, **kwargs)


def _outputs(result: InferResult) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = result.as_numpy("out")
    lse = result.as_numpy("lse")
    return to_torch(out), None if lse is None else to_torch(lse)


def _good_batch(dtype=torch.bfloat16):
    return make_batch(BATCH_SPECS["ragged"], MLA, dtype)


def _assert_healthy(server: Server, client: InferenceServerClient, headers=None) -> None:
    """`/health` ok, every worker alive, and a good request answered right."""
    health = server.health()
    assert health["status"] == "ok", health
    assert all(w["alive"] for w in health["workers"]), health
    q, k, v, q_cu, _ = _good_batch()
    result = _infer(client, _arrays(q, k, v, q_cu), headers=headers)
    out, lse = _outputs(result)
    assert lse is None
    assert_close_to_reference(q, k, v, q_cu, None, True, out)


@dataclass
class Refusal:
    status: str
    message: str


def _refused(call: Callable[[], object], status: int | None = None, *fragments: str) -> Refusal:
    """`call` raises InferenceServerException with `status` (any 4xx when None) and a message
    matching every fragment (regular expressions)."""
    with pytest.raises(InferenceServerException) as info:
        call()
    got = Refusal(str(info.value.status()), str(info.value.message()))
    if status is None:
        assert got.status.startswith("4"), got
    else:
        assert got.status == str(status), got
    assert got.message, got
    for part in fragments:
        assert re.search(part, got.message), (part, got)
    return got


# ---------------------------------------------------------------------------------------------
# 1. metadata and health


def test_server_metadata_live_and_ready(client, shm_client):
    meta = client.get_server_metadata()
    assert meta["name"] == "zen-mla" and meta["version"] == __version__
    assert {"binary_tensor_data", "parameters"} <= set(meta["extensions"])
    assert "system_shared_memory" not in meta["extensions"]
    assert "system_shared_memory" in shm_client.get_server_metadata()["extensions"]
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("nope") and not client.is_model_ready(MODEL, "2")


@pytest.mark.parametrize("version", ["", "1"], ids=["latest", "v1"])
def test_model_metadata(client, version):
    meta = client.get_model_metadata(MODEL, version)
    assert meta["name"] == MODEL and meta["versions"] == ["1"] and meta["platform"] == "zen-mla"
    inputs = {i["name"]: i for i in meta["inputs"]}
    assert list(inputs) == ["q", "k", "v", "kv_c", "k_pe", "q_cu_seq_lens", "kv_cu_seq_lens"]
    for name in ("kv_c", "k_pe"):  # over the latent cache, in place of k and v
        assert inputs[name]["shape"] == [-1, -1] and inputs[name]["parameters"]["optional"]
    for name in ("q", "k", "v"):
        assert inputs[name]["datatype"] == "BF16" and inputs[name]["shape"] == [-1, -1, -1]
        assert inputs[name]["parameters"]["datatypes"] == ["BF16", "FP16", "FP32"]
        assert not inputs[name]["parameters"].get("optional", False)
    for name in ("q_cu_seq_lens", "kv_cu_seq_lens"):
        assert inputs[name]["datatype"] == "INT32" and inputs[name]["shape"] == [-1]
        assert inputs[name]["parameters"]["datatypes"] == ["INT32", "INT64"]
    assert not inputs["q_cu_seq_lens"]["parameters"].get("optional", False)
    assert inputs["kv_cu_seq_lens"]["parameters"]["optional"] is True
    outputs = {o["name"]: o for o in meta["outputs"]}
    assert list(outputs) == ["out", "lse"]
    assert outputs["out"]["datatype"] == "BF16" and outputs["out"]["shape"] == [-1, -1, -1]
    assert outputs["lse"]["datatype"] == "FP32" and outputs["lse"]["shape"] == [-1, -1]


@pytest.mark.parametrize(("model", "version"), [("nope", ""), (MODEL, "2"), ("nope", "1")])
def test_unknown_model_or_version_is_404(server, client, model, version):
    _refused(lambda: client.get_model_metadata(model, version), 404)
    q, k, v, q_cu, _ = _good_batch()
    inputs = [_input(n, a) for n, a in _arrays(q, k, v, q_cu)]
    _refused(lambda: client.infer(model, inputs, model_version=version), 404)
    with server.client() as c:
        r = c.get(f"/v2/models/{model}" + (f"/versions/{version}" if version else ""))
    assert r.status_code == 404 and list(r.json()) == ["error"], r.text


# ---------------------------------------------------------------------------------------------
# 2. infer: binary and JSON tensors against the fp64 reference

SPECS = ["ragged", "prefix_cached", "more_queries_than_keys", "context_chunk"]


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("spec", SPECS)
def test_binary_infer_matches_the_reference(client, spec, dtype, causal, return_lse):
    q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS[spec], MLA, dtype)
    result = _infer(
        client,
        _arrays(q, k, v, q_cu, kv_cu),
        parameters={"causal": causal, "return_lse": return_lse},
    )
    answer = result.get_response()
    assert answer["model_name"] == MODEL and answer["model_version"] == "1"
    names = [o["name"] for o in answer["outputs"]]
    assert names == (["out", "lse"] if return_lse else ["out"])
    tq, h, dv = q.shape[0], q.shape[1], v.shape[2]
    want = {"out": (np_to_triton_dtype(to_numpy(v).dtype), [tq, h, dv]), "lse": ("FP32", [h, tq])}
    for o in answer["outputs"]:
        assert (o["datatype"], o["shape"]) == want[o["name"]], o
        assert "data" not in o and o["parameters"]["binary_data_size"] >= 0
    assert isinstance(answer["parameters"]["kernel"], str) and answer["parameters"]["kernel"]
    assert ("lse_kernel" in answer["parameters"]) == return_lse
    out, lse = _outputs(result)
    assert_close_to_reference(q, k, v, q_cu, kv_cu, causal, out, lse)


@pytest.mark.parametrize("spec", EMPTY_SPECS.values(), ids=EMPTY_SPECS.keys())
def test_batches_with_nothing_in_them(client, spec):
    q, k, v, q_cu, kv_cu = make_batch(spec, MLA, torch.bfloat16)
    result = _infer(client, _arrays(q, k, v, q_cu, kv_cu), parameters={"return_lse": True})
    out, lse = _outputs(result)
    assert_close_to_reference(q, k, v, q_cu, kv_cu, True, out, lse)


OUTPUT_MODES = {
    "out_bin_lse_bin": ({"out": True, "lse": True}, True),
    "out_json_lse_json": ({"out": False, "lse": False}, True),
    "out_json_lse_bin": ({"out": False, "lse": True}, True),
    "only_out_json": ({"out": False}, False),
    "only_lse_json": ({"lse": False}, True),
}


@pytest.mark.parametrize("mode", OUTPUT_MODES.values(), ids=OUTPUT_MODES.keys())
@pytest.mark.parametrize("json_inputs", [False, True], ids=["bin_in", "json_in"])
def test_named_outputs_binary_or_json(client, json_inputs, mode):
    binary, return_lse = mode
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["single"], MLA, torch.float32)
    outputs = [InferRequestedOutput(name, binary_data=b) for name, b in binary.items()]
    result = _infer(
        client,
        _arrays(q, k, v, q_cu),
        binary=not json_inputs,
        outputs=outputs,
        parameters={"return_lse": return_lse},
    )
    got = {o["name"]: o for o in result.get_response()["outputs"]}
    assert set(got) == set(binary)
    for name, b in binary.items():
        params = got[name].get("parameters") or {}
        assert ("binary_data_size" in params) == b, got[name]
        assert ("data" in got[name]) == (not b), got[name]
    ref_out = result.as_numpy("out")
    ref_lse = result.as_numpy("lse")
    if ref_out is None:  # only lse asked: check it against a full answer
        full = _infer(client, _arrays(q, k, v, q_cu), parameters={"return_lse": True})
        out = to_torch(full.as_numpy("out"))
    else:
        out = to_torch(ref_out)
    lse = None if ref_lse is None else to_torch(ref_lse)
    assert_close_to_reference(q, k, v, q_cu, None, True, out, lse)


@pytest.mark.parametrize("kv", ["omitted", "given"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_cu_seq_lens_int32_int64_and_kv_omitted(client, cu_dtype, kv):
    q, k, v, q_cu, _ = _good_batch()
    q_cu = q_cu.to(cu_dtype)
    kv_cu = q_cu.clone() if kv == "given" else None
    if kv_cu is not None:
        k, v = k[:-3], v[:-3]  # kv lens differ from q's: proves kv_cu_seq_lens is read
        kv_cu[-1] -= 3
    result = _infer(client, _arrays(q, k, v, q_cu, kv_cu), parameters={"return_lse": True})
    out, lse = _outputs(result)
    assert_close_to_reference(q, k, v, q_cu, kv_cu, True, out, lse)


@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [("reference", torch.bfloat16), ("torch", torch.float16), ("auto", torch.float32)],
)
def test_kernel_parameters_scale_and_request_id(client, kernel, dtype):
    q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS["prefix_cached"], MLA, dtype)
    result = _infer(
        client,
        _arrays(q, k, v, q_cu, kv_cu),
        parameters={"kernel": kernel, "return_lse": True, "scale": 0.05},
        request_id=f"req-{kernel}",
        model_version="1",
    )
    answer = result.get_response()
    assert answer["id"] == f"req-{kernel}" and answer["model_version"] == "1"
    params = answer["parameters"]
    if kernel == "auto":
        assert params["kernel"] in ("native", "zentorch", "torch"), params
    else:
        assert params["kernel"] == kernel, params
    assert params["lse_kernel"] in ("native", "zentorch", "torch", "reference"), params
    out, lse = _outputs(result)
    assert_close_to_reference(q, k, v, q_cu, kv_cu, True, out, lse, scale=0.05)


@pytest.mark.parametrize("dtype", ["FP32", "BF16"])
def test_raw_json_request_nested_data_and_json_answer(server, dtype):
    """JSON inputs (nested lists, BF16 too, which tritonclient will not send as JSON), no
    outputs named, no binary_data_output: every output comes back as JSON, no binary part."""
    q, k, v, q_cu, _ = make_batch(BATCH_SPECS["equal_runs"], (2, 16, 8), torch.float32)
    if dtype == "BF16":
        q, k, v = (t.bfloat16() for t in (q, k, v))
    tensors = {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}
    request = {
        "id": "json-1",
        "inputs": [
            {
                "name": n,
                "datatype": dtype if n != "q_cu_seq_lens" else "INT32",
                "shape": list(t.shape),
                "data": t.tolist(),  # nested
            }
            for n, t in tensors.items()
        ],
        "parameters": {"return_lse": True, "causal": True},
    }
    with server.client() as c:
        r = c.post(INFER, json=request)
    assert r.status_code == 200, r.text
    assert "inference-header-content-length" not in r.headers
    answer = r.json()
    assert answer["id"] == "json-1"
    got = {o["name"]: o for o in answer["outputs"]}
    assert got["out"]["datatype"] == dtype and got["lse"]["datatype"] == "FP32"
    out = torch.tensor(got["out"]["data"], dtype=torch.float32).reshape(got["out"]["shape"])
    lse = torch.tensor(got["lse"]["data"], dtype=torch.float32).reshape(got["lse"]["shape"])
    assert_close_to_reference(q, k, v, q_cu, None, True, out.to(v.dtype), lse)


def _metric_counts(text: str) -> dict[tuple[str, str], float]:
    counts = {}
    for line in text.splitlines():
        if not line.startswith("zen_mla_requests_total{"):
            continue
        labels, value = line[len("zen_mla_requests_total{") :].rsplit("} ", 1)
        pairs = dict(p.split("=", 1) for p in labels.split(","))
        pairs = {a: b.strip('"') for a, b in pairs.items()}
        counts[(pairs.get("route", ""), pairs.get("status", ""))] = float(value)
    return counts


def test_metrics_count_v2_requests(server, client):
    with server.client() as c:
        before = _metric_counts(c.get("/metrics").text)
        q, k, v, q_cu, _ = _good_batch()
        _infer(client, _arrays(q, k, v, q_cu))
        _refused(lambda: _infer(client, _arrays(q, k, v, q_cu)[1:]), 422)
        after = _metric_counts(c.get("/metrics").text)
    for status in ("200", "422"):
        assert after.get(("v2", status), 0) >= before.get(("v2", status), 0) + 1, after


# ---------------------------------------------------------------------------------------------
# 3. system shared memory


@dataclass
class Regions:
    """Shared memory objects made here and regions registered with a server; all undone on
    teardown (unregistered, unmapped, unlinked)."""

    client: InferenceServerClient
    handles: list = field(default_factory=list)
    names: list = field(default_factory=list)

    def create(self, nbytes: int) -> tuple[shm.SharedMemoryRegion, str]:
        key = f"/zen_mla_kserve_{os.getpid()}_{next(_KEYS)}"
        handle = shm.create_shared_memory_region(key, key, nbytes, create_only=True)
        self.handles.append(handle)
        return handle, key

    def register(self, name: str, key: str, nbytes: int, offset: int = 0) -> None:
        self.names.append(name)
        self.client.register_system_shared_memory(name, key, nbytes, offset=offset)

    def close(self) -> None:
        for name in self.names:
            with contextlib.suppress(InferenceServerException):
                self.client.unregister_system_shared_memory(name)
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions(shm_client) -> Iterator[Regions]:
    r = Regions(shm_client)
    try:
        yield r
    finally:
        r.close()


def _layout(arrays, start: int = 0, align: int = 64) -> tuple[dict[str, int], int]:
    """Offsets for `arrays` one after another from `start`, aligned; and the end."""
    offsets, at = {}, start
    for name, a in arrays:
        offsets[name] = at
        at += (a.nbytes + align - 1) // align * align
    return offsets, at


def _read(handle, a_dtype, shape, offset: int) -> np.ndarray:
    return np.array(shm.get_contents_as_numpy(handle, a_dtype, shape, offset))  # a copy


def _garbage(handle, nbytes: int, offset: int = 0) -> None:
    shm.set_shared_memory_region(handle, [np.full(nbytes, 0xFF, np.uint8)], offset)


def _shm_inputs(regions: Regions, arrays, name: str = "inputs", object_offset: int = 4096):
    """Every array in a region registered `object_offset` bytes into its object."""
    offsets, end = _layout(arrays)
    handle, key = regions.create(object_offset + end)
    inputs = []
    for n, a in arrays:
        shm.set_shared_memory_region(handle, [a], object_offset + offsets[n])
        i = InferInput(n, list(a.shape), np_to_triton_dtype(a.dtype))
        i.set_shared_memory(name, a.nbytes, offsets[n])
        inputs.append(i)
    regions.register(name, key, end, offset=object_offset)
    return inputs, handle, key


SHM_MODES = ["in_shm_out_binary", "in_binary_out_shm", "all_shm_two_out_regions", "one_out_region"]


@pytest.mark.parametrize("mode", SHM_MODES)
def test_shared_memory_round_trip(shm_client, regions, mode):
    q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS["prefix_cached"], MLA, torch.bfloat16)
    arrays = _arrays(q, k, v, q_cu, kv_cu)
    tq, h, dv = q.shape[0], q.shape[1], v.shape[2]
    out_bytes, lse_bytes = tq * h * dv * 2, h * tq * 4
    if mode == "in_binary_out_shm":
        inputs = [_input(n, a) for n, a in arrays]
    else:
        inputs, _, _ = _shm_inputs(regions, arrays)
    places = {}  # output -> (handle, offset in the object)
    outputs = [InferRequestedOutput("out"), InferRequestedOutput("lse")]
    if mode in ("in_binary_out_shm", "all_shm_two_out_regions"):
        for o, name, nbytes in ((outputs[0], "out", out_bytes), (outputs[1], "lse", lse_bytes)):
            handle, key = regions.create(nbytes)
            _garbage(handle, nbytes)
            regions.register(f"{name}_region", key, nbytes)
            o.set_shared_memory(f"{name}_region", nbytes, 0)
            places[name] = (handle, 0)
    elif mode == "one_out_region":
        handle, key = regions.create(8192 + out_bytes + lse_bytes + 256)
        _garbage(handle, 8192 + out_bytes + lse_bytes + 256)
        regions.register("outs", key, 4096 + out_bytes + lse_bytes + 256, offset=4096)
        lse_at = 128 + (out_bytes + 63) // 64 * 64
        outputs[0].set_shared_memory("outs", out_bytes, 128)
        outputs[1].set_shared_memory("outs", lse_bytes, lse_at)
        places = {"out": (handle, 4096 + 128), "lse": (handle, 4096 + lse_at)}
    result = shm_client.infer(
        MODEL, inputs, outputs=outputs, parameters={"return_lse": True}, request_id=mode
    )
    answer = result.get_response()
    assert answer["id"] == mode
    got = {o["name"]: o for o in answer["outputs"]}
    assert set(got) == {"out", "lse"}
    for name in places:
        params = got[name]["parameters"]
        assert "data" not in got[name] and "binary_data_size" not in params, got[name]
        assert params["shared_memory_byte_size"] == (out_bytes if name == "out" else lse_bytes)
        assert params["shared_memory_region"]
    if places:
        out_h, out_at = places["out"]
        lse_h, lse_at = places["lse"]
        out = to_torch(_read(out_h, ml_dtypes.bfloat16, [tq, h, dv], out_at))
        lse = to_torch(_read(lse_h, np.float32, [h, tq], lse_at))
    else:
        out, lse = _outputs(result)
    assert_close_to_reference(q, k, v, q_cu, kv_cu, True, out, lse)


def _keyless(key: str) -> str:
    return key.lstrip("/")


def test_shared_memory_register_status_unregister(shm_client, regions):
    shm_client.unregister_system_shared_memory()  # all: nothing left from other tests
    assert shm_client.get_system_shared_memory_status() == []
    _, key_a = regions.create(4096)
    _, key_b = regions.create(8192)
    regions.register("a", key_a, 4096)
    regions.register("b", key_b, 4000, offset=4096)
    status = {s["name"]: s for s in shm_client.get_system_shared_memory_status()}
    assert set(status) == {"a", "b"}
    assert _keyless(status["b"]["key"]) == _keyless(key_b), status
    assert (status["b"]["offset"], status["b"]["byte_size"]) == (4096, 4000)
    assert (status["a"]["offset"], status["a"]["byte_size"]) == (0, 4096)
    one = shm_client.get_system_shared_memory_status("a")
    assert [s["name"] for s in one] == ["a"] and _keyless(one[0]["key"]) == _keyless(key_a)
    _refused(lambda: shm_client.register_system_shared_memory("a", key_b, 64), 422)
    shm_client.unregister_system_shared_memory("a")
    assert [s["name"] for s in shm_client.get_system_shared_memory_status()] == ["b"]
    _refused(lambda: shm_client.get_system_shared_memory_status("a"), 404)
    shm_client.unregister_system_shared_memory("never-registered")  # silently, as Triton
    shm_client.register_system_shared_memory("a", key_a, 4096)  # the name is free again
    shm_client.unregister_system_shared_memory()
    assert shm_client.get_system_shared_memory_status() == []


def test_shared_memory_region_cap(shm_client, regions):
    shm_client.unregister_system_shared_memory()
    _, key = regions.create(4096)
    for i in range(8):  # the fixture's system_shm_max_regions
        regions.register(f"r{i}", key, 64, offset=64 * i)
    _refused(lambda: regions.register("r8", key, 64, offset=512), 422)
    shm_client.unregister_system_shared_memory("r0")
    regions.register("r8", key, 64, offset=512)  # room again


OFF_CALLS = {
    "status": lambda c: c.get_system_shared_memory_status(),
    "region_status": lambda c: c.get_system_shared_memory_status("x"),
    "register": lambda c: c.register_system_shared_memory("x", "/zen_mla_kserve_none", 64),
    "unregister": lambda c: c.unregister_system_shared_memory("x"),
    "unregister_all": lambda c: c.unregister_system_shared_memory(),
    "infer_input_in_shm": lambda c: _infer_with_shm(c, "input"),
    "infer_output_in_shm": lambda c: _infer_with_shm(c, "output"),
}


def _infer_with_shm(client: InferenceServerClient, where: str) -> InferResult:
    q, k, v, q_cu, _ = _good_batch()
    arrays = _arrays(q, k, v, q_cu)
    inputs = [_input(n, a) for n, a in arrays]
    outputs = [InferRequestedOutput("out")]
    if where == "input":
        inputs[0] = InferInput("q", list(arrays[0][1].shape), "BF16")
        inputs[0].set_shared_memory("x", arrays[0][1].nbytes)
    else:
        outputs[0].set_shared_memory("x", q.shape[0] * 2 * 128 * 2)
    return client.infer(MODEL, inputs, outputs=outputs)


@pytest.mark.parametrize("call", OFF_CALLS.values(), ids=OFF_CALLS.keys())
def test_shared_memory_off_is_403(server, client, call):
    _refused(lambda: call(client), 403, "ZEN_MLA_SYSTEM_SHM")
    _assert_healthy(server, client)


@pytest.fixture
def odd_keys() -> Iterator[dict[str, str]]:
    """A symlink and a directory in /dev/shm, both under names the service must refuse."""
    tag = f"zen_mla_kserve_{os.getpid()}"
    link, folder = f"/dev/shm/{tag}_link", f"/dev/shm/{tag}_dir"
    os.symlink("/etc/passwd", link)
    os.mkdir(folder)
    try:
        yield {"link": f"/{tag}_link", "dir": f"/{tag}_dir"}
    finally:
        os.unlink(link)
        os.rmdir(folder)


BAD_KEYS = {
    "dotdot": lambda keys, real: ("../etc/passwd", 64, 0),
    "nested": lambda keys, real: ("/a/b", 64, 0),
    "absolute_path": lambda keys, real: ("/dev/shm" + real, 64, 0),
    "absent": lambda keys, real: (f"/zen_mla_kserve_absent_{os.getpid()}", 64, 0),
    "empty": lambda keys, real: ("", 64, 0),
    "symlink_to_passwd": lambda keys, real: (keys["link"], 64, 0),
    "directory": lambda keys, real: (keys["dir"], 64, 0),
    "past_the_object": lambda keys, real: (real, 4097, 0),
    "offset_past_the_object": lambda keys, real: (real, 200, 4000),
    "negative_offset": lambda keys, real: (real, 64, -64),
}


@pytest.mark.parametrize("bad", BAD_KEYS.values(), ids=BAD_KEYS.keys())
def test_shared_memory_bad_registrations_are_refused(
    shm_server, shm_client, regions, odd_keys, bad
):
    _, real = regions.create(4096)
    key, nbytes, offset = bad(odd_keys, real)
    refusal = _refused(lambda: regions.register("bad", key, nbytes, offset))
    assert refusal.status in ("400", "404", "422"), refusal
    names = [s["name"] for s in shm_client.get_system_shared_memory_status()]
    assert "bad" not in names
    _assert_healthy(shm_server, shm_client)


SHM_RANGES = {
    # (what to change, the fragment); the inputs' region is exactly as long as they need
    "input_past_region": ("q", "offset", "q"),
    "input_byte_size_not_shape": ("q", "size", "q"),
    "output_too_small": ("out", "size", "out"),
    "output_past_region": ("out", "offset", "out"),
}


@pytest.mark.parametrize("case", SHM_RANGES.values(), ids=SHM_RANGES.keys())
def test_shared_memory_ranges_outside_their_region_are_422(shm_server, shm_client, regions, case):
    tensor, change, fragment = case
    q, k, v, q_cu, _ = _good_batch()
    arrays = _arrays(q, k, v, q_cu)
    inputs, _, _ = _shm_inputs(regions, arrays, object_offset=0)
    _, region_end = _layout(arrays)
    out_bytes = q.shape[0] * MLA[0] * MLA[2] * 2
    out = InferRequestedOutput("out")
    _, key = regions.create(out_bytes)
    regions.register("out_region", key, out_bytes)
    out.set_shared_memory("out_region", out_bytes, 0)
    if tensor == "q":
        nbytes = arrays[0][1].nbytes
        if change == "offset":
            inputs[0].set_shared_memory("inputs", nbytes, region_end - nbytes + 64)
        else:
            inputs[0].set_shared_memory("inputs", nbytes - 2, 0)
    elif change == "size":
        out.set_shared_memory("out_region", out_bytes - 2, 0)
    else:
        out.set_shared_memory("out_region", out_bytes, 64)
    _refused(lambda: shm_client.infer(MODEL, inputs, outputs=[out]), 422, fragment)
    _assert_healthy(shm_server, shm_client)


def test_an_unregistered_region_is_refused(shm_server, shm_client):
    q, k, v, q_cu, _ = _good_batch()
    arrays = _arrays(q, k, v, q_cu)
    inputs = [_input(n, a) for n, a in arrays]
    inputs[1] = InferInput("k", list(arrays[1][1].shape), "BF16")
    inputs[1].set_shared_memory("nowhere", arrays[1][1].nbytes)
    refusal = _refused(lambda: shm_client.infer(MODEL, inputs), None, "nowhere")
    assert refusal.status in ("400", "404", "422"), refusal
    _assert_healthy(shm_server, shm_client)


@pytest.mark.parametrize("which", ["inputs", "outputs"])
def test_a_shrunk_region_is_refused_and_the_service_stays_up(
    shm_server, shm_client, regions, which
):
    q, k, v, q_cu, kv_cu = make_batch(BATCH_SPECS["prefix_cached"], MLA, torch.bfloat16)
    arrays = _arrays(q, k, v, q_cu, kv_cu)
    outputs = [InferRequestedOutput("out")]
    if which == "inputs":
        inputs, _, key = _shm_inputs(regions, arrays, name="shrinks", object_offset=4096)
    else:
        inputs = [_input(n, a) for n, a in arrays]
        out_bytes = q.shape[0] * MLA[0] * MLA[2] * 2
        handle, key = regions.create(4096 + out_bytes)
        regions.register("shrinks", key, out_bytes, offset=4096)
        outputs[0].set_shared_memory("shrinks", out_bytes)

    def run() -> torch.Tensor:
        result = shm_client.infer(MODEL, inputs, outputs=outputs)
        if which == "inputs":
            return _outputs(result)[0]
        return to_torch(_read(handle, ml_dtypes.bfloat16, [q.shape[0], MLA[0], MLA[2]], 4096))

    assert_close_to_reference(q, k, v, q_cu, kv_cu, True, run())
    fd = os.open(f"/dev/shm/{_keyless(key)}", os.O_RDWR)
    try:
        os.ftruncate(fd, 4096)  # every byte of the region gone
    finally:
        os.close(fd)
    for _ in range(2):
        _refused(run, 422, "shrinks")
    assert shm_server.process.poll() is None
    _assert_healthy(shm_server, shm_client)
    shm_client.unregister_system_shared_memory("shrinks")
    _assert_healthy(shm_server, shm_client)


def test_a_region_shrunk_while_workers_read_it_costs_that_request_only(
    shm_server, shm_client, regions
):
    """The hardest case: the object shrinks after the service checked it, while the workers
    read it. A worker faults (SIGBUS) or fails to map it; the request is a 422 naming the
    region, the workers are replaced, and the service goes on."""
    x = torch.randn(6000, 8, 192)  # non-causal fp32 reference: seconds of work on 2 cores
    arrays = _arrays(x, x, x[..., :128].contiguous(), torch.tensor([0, 6000], dtype=torch.int32))
    inputs, _, key = _shm_inputs(regions, arrays, name="shrinks_late")
    restarts = sum(w["restarts"] for w in shm_server.health()["workers"])
    answered = threading.Event()

    def shrink_once_a_worker_reads_it() -> None:
        # a worker holds the request: the service's check is behind it, the workers' read not
        while not answered.is_set():
            if any(w["state"] == "busy" for w in shm_server.health()["workers"]):
                os.truncate(f"/dev/shm/{_keyless(key)}", 4096)
                return
            time.sleep(0.02)

    shrinker = threading.Thread(target=shrink_once_a_worker_reads_it)
    shrinker.start()
    try:
        _refused(
            lambda: shm_client.infer(
                MODEL, inputs, parameters={"kernel": "reference", "causal": False}
            ),
            422,
            "shrinks_late",
            "shrunk",
        )
    finally:
        answered.set()
        shrinker.join()
    assert shm_server.process.poll() is None
    health = wait_ready(shm_server)
    assert sum(w["restarts"] for w in health["workers"]) > restarts
    _assert_healthy(shm_server, shm_client)


def test_a_slow_v2_upload_is_cut_off_and_others_are_served(tmp_path):
    """/v2 bodies are read as /prefill bodies are: below the minimum rate after the grace, a
    408 in the protocol's form, and a request meanwhile is answered."""
    with serve(tmp_path, workers=1, min_body_rate=50_000, body_grace_s=0.5) as server:
        with socket.create_connection(
            (urlparse(server.url).hostname, urlparse(server.url).port)
        ) as slow:
            head = (
                f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n"
                "Inference-Header-Content-Length: 1000\r\n\r\n"
            )
            slow.sendall(head.encode() + b"{" + b" " * 100)
            with _triton(server) as c:
                _assert_healthy(server, c)
            slow.settimeout(10)
            answer = b""
            while chunk := slow.recv(65536):
                answer += chunk
        status, _, rest = answer.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 408"), answer[:200]
        body = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert set(body) == {"error"} and "slower than 50000 bytes/s" in body["error"]


# ---------------------------------------------------------------------------------------------
# 4. bad requests: 4xx naming the problem, the service healthy after


@dataclass
class Request:
    arrays: list[tuple[str, np.ndarray]]
    params: dict
    outputs: list[str] | None = None

    def set(self, name: str, a: np.ndarray) -> Request:
        self.arrays = [(n, a if n == name else x) for n, x in self.arrays]
        return self

    def get(self, name: str) -> np.ndarray:
        return dict(self.arrays)[name]

    def drop(self, name: str) -> Request:
        self.arrays = [(n, x) for n, x in self.arrays if n != name]
        return self


def _good_request() -> Request:
    q, k, v, q_cu, _ = _good_batch()
    return Request(_arrays(q, k, v, q_cu), {})


def _cu(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


T = 233  # the good batch's tokens ("ragged")
BIG = np.zeros((20000, 1, 192), ml_dtypes.bfloat16)  # 7.7e10 work with causal false > 2^36

BAD_REQUESTS: dict[str, tuple[Callable[[Request], Request], str]] = {
    "q_int32": (lambda r: r.set("q", r.get("q").astype(np.int32)), r"\bq\.datatype"),
    "q_fp16_kv_bf16": (lambda r: r.set("q", r.get("q").astype(np.float16)), r"\b[kv]\b"),
    "q_2d": (lambda r: r.set("q", r.get("q").reshape(T, -1)), r"\bq[:.]"),
    "k_heads_not_q_heads": (
        lambda r: r.set("k", np.zeros((T, 3, 192), ml_dtypes.bfloat16)),
        r"\bk[:.]",
    ),
    "v_dim_over_q_dim": (
        lambda r: r.set("v", np.zeros((T, 2, 256), ml_dtypes.bfloat16)),
        r"\bv[:.]",
    ),
    "v_tokens_not_k_tokens": (lambda r: r.set("v", r.get("v")[:-1]), r"\b[kv]\b"),
    "q_cu_short_of_t": (lambda r: r.set("q_cu_seq_lens", _cu(0, 5, T - 1)), "q_cu_seq_lens"),
    "q_cu_past_t": (lambda r: r.set("q_cu_seq_lens", _cu(0, 5, T + 1)), "q_cu_seq_lens"),
    "q_cu_decreasing": (lambda r: r.set("q_cu_seq_lens", _cu(0, 50, 20, T)), "q_cu_seq_lens"),
    "q_cu_not_from_0": (lambda r: r.set("q_cu_seq_lens", _cu(3, T)), "q_cu_seq_lens"),
    "q_cu_fp32": (
        lambda r: r.set("q_cu_seq_lens", np.array([0, T], np.float32)),
        "q_cu_seq_lens",
    ),
    "q_cu_2d": (lambda r: r.set("q_cu_seq_lens", _cu(0, 5, T).reshape(1, 3)), "q_cu_seq_lens"),
    "kv_cu_other_batch": (
        lambda r: Request([*r.arrays, ("kv_cu_seq_lens", _cu(0, T))], {}),
        "kv_cu_seq_lens",
    ),
    "missing_q": (lambda r: r.drop("q"), r"\bq\b"),
    "missing_q_cu": (lambda r: r.drop("q_cu_seq_lens"), "q_cu_seq_lens"),
    "unknown_input": (lambda r: Request([*r.arrays, ("extra", _cu(1))], {}), "extra"),
    "duplicate_q": (lambda r: Request([*r.arrays, ("q", r.get("q"))], {}), r"\bq\b"),
    "unknown_parameter": (lambda r: Request(r.arrays, {"retrun_lse": True}), "return_lse"),
    "causal_not_bool": (lambda r: Request(r.arrays, {"causal": "yes"}), "causal"),
    "lse_without_return_lse": (lambda r: Request(r.arrays, {}, ["out", "lse"]), "return_lse"),
    "unknown_output": (lambda r: Request(r.arrays, {}, ["out", "attn"]), "attn"),
    "kernel_nope": (lambda r: Request(r.arrays, {"kernel": "nope"}), "kernel"),
    "scale_zero": (lambda r: Request(r.arrays, {"scale": 0}), "scale"),
    "scale_negative": (lambda r: Request(r.arrays, {"scale": -0.5}), "scale"),
    "scale_not_number": (lambda r: Request(r.arrays, {"scale": "big"}), "scale"),
    "work_over_the_cap": (
        lambda r: Request(
            [("q", BIG), ("k", BIG), ("v", BIG[..., :128]), ("q_cu_seq_lens", _cu(0, 20000))],
            {"causal": False},
        ),
        "work",
    ),
}


@pytest.mark.parametrize("bad", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_are_422_naming_the_problem(server, client, bad):
    change, fragment = bad
    r = change(_good_request())
    outputs = None if r.outputs is None else [InferRequestedOutput(n) for n in r.outputs]
    _refused(lambda: _infer(client, r.arrays, outputs=outputs, parameters=r.params), 422, fragment)
    _assert_healthy(server, client)


def _raw_body(arrays, *, sizes: dict[str, int] | None = None) -> tuple[bytes, bytes]:
    """The JSON header and the binary part of a binary-tensor request."""
    sizes = sizes or {}
    header = {
        "inputs": [
            {
                "name": n,
                "datatype": np_to_triton_dtype(a.dtype),
                "shape": list(a.shape),
                "parameters": {"binary_data_size": sizes.get(n, a.nbytes)},
            }
            for n, a in arrays
        ]
    }
    return json.dumps(header).encode(), b"".join(a.tobytes() for _, a in arrays)


def _raw_case(name: str) -> tuple[bytes, dict[str, str], int, str]:
    """(body, headers, status, a fragment of the error) for raw-HTTP case `name`."""
    arrays = _good_request().arrays
    head, data = _raw_body(arrays)
    ihcl = {"Inference-Header-Content-Length": str(len(head))}
    octet = {"Content-Type": "application/octet-stream"}
    if name == "binary_size_not_shape":  # q says 2 bytes less, and sends 2 bytes less
        q = arrays[0][1]
        head, _ = _raw_body(arrays, sizes={"q": q.nbytes - 2})
        data = q.tobytes()[:-2] + b"".join(a.tobytes() for _, a in arrays[1:])
        ihcl = {"Inference-Header-Content-Length": str(len(head))}
        return head + data, octet | ihcl, 422, r"\bq\b.*binary_data_size|binary_data_size.*\bq\b"
    if name == "sizes_short_of_body":
        return head + data + b"\0" * 10, octet | ihcl, 400, ""
    if name == "sizes_past_body":
        return head + data[:-10], octet | ihcl, 400, ""
    if name == "header_length_past_body":
        body = head + data
        return body, octet | {"Inference-Header-Content-Length": str(len(body) + 1)}, 400, ""
    if name == "header_length_not_a_number":
        return head + data, octet | {"Inference-Header-Content-Length": "abc"}, 400, ""
    if name == "header_length_negative":
        return head + data, octet | {"Inference-Header-Content-Length": "-1"}, 400, ""
    if name == "header_length_cuts_the_json":
        return head + data, octet | {"Inference-Header-Content-Length": "10"}, 400, ""
    if name == "invalid_json":
        return b'{"inputs": [', {"Content-Type": "application/json"}, 400, ""
    if name == "gzip_body":
        gz = gzip.compress(head + data)
        return gz, octet | ihcl | {"Content-Encoding": "gzip"}, 415, ""
    raise AssertionError(name)


RAW_CASES = [
    "binary_size_not_shape",
    "sizes_short_of_body",
    "sizes_past_body",
    "header_length_past_body",
    "header_length_not_a_number",
    "header_length_negative",
    "header_length_cuts_the_json",
    "invalid_json",
    "gzip_body",
]


@pytest.mark.parametrize("case", RAW_CASES)
def test_raw_http_bad_bodies(server, client, case):
    body, headers, status, fragment = _raw_case(case)
    with server.client() as c:
        r = c.post(INFER, content=body, headers=headers)
    assert r.status_code == status, r.text
    answer = r.json()
    assert list(answer) == ["error"] and isinstance(answer["error"], str) and answer["error"]
    assert re.search(fragment, answer["error"]), answer
    _assert_healthy(server, client)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compressed_request_is_415(server, client, algorithm):
    q, k, v, q_cu, _ = _good_batch()

    def call():
        return _infer(client, _arrays(q, k, v, q_cu), request_compression_algorithm=algorithm)

    _refused(call, 415)
    _assert_healthy(server, client)


def _recv_answer(s: socket.socket) -> str:
    """One HTTP answer read off `s`: its head and its Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
    while length and len(body) < int(length.group(1)):
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def _announce(server: Server, headers: str) -> str:
    """Send only the head of an infer request (its body never comes); the answer."""
    host, port = urlparse(server.url).hostname, urlparse(server.url).port
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        return _recv_answer(s)


def _error_of(answer: str) -> str:
    body = json.loads(answer.split("\r\n\r\n", 1)[1])
    assert list(body) == ["error"], answer
    return str(body["error"])


def test_raw_http_411_and_413(server, client):
    head, data = _raw_body(_good_request().arrays)
    headers = {"Inference-Header-Content-Length": str(len(head))}
    with server.client() as c:
        r = c.post(INFER, content=iter([head + data]), headers=headers)  # chunked
    assert r.status_code == 411 and list(r.json()) == ["error"], r.text
    octet = "Content-Type: application/octet-stream\r\n"
    # 100 GiB announced, nothing sent: over max_body_bytes, answered before any body
    answer = _announce(server, octet + "Content-Length: 107374182400\r\n")
    assert answer.startswith("HTTP/1.1 413"), answer
    assert _error_of(answer)
    # 20 MiB of body of which 17 MiB JSON: over max_json_bytes (16 MiB by default)
    answer = _announce(
        server,
        octet + f"Content-Length: {20 << 20}\r\nInference-Header-Content-Length: {17 << 20}\r\n",
    )
    assert answer.startswith("HTTP/1.1 413"), answer
    assert re.search(r"(?i)json|inference.header", _error_of(answer)), answer
    _assert_healthy(server, client)


# ---------------------------------------------------------------------------------------------
# 5. the token, and a request's own timeout


def test_the_token_guards_infer_not_health_or_metadata(token_server):
    with _triton(token_server) as c:
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(MODEL)
        assert c.get_server_metadata()["name"] == "zen-mla"
        assert c.get_model_metadata(MODEL)["name"] == MODEL
        q, k, v, q_cu, _ = _good_batch()
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            _refused(lambda h=headers: _infer(c, _arrays(q, k, v, q_cu), headers=h), 401)
        _assert_healthy(token_server, c, headers=TOKEN)
    with httpx.Client() as h:
        r = h.post(token_server.url + INFER, json={"inputs": []})
    assert r.status_code == 401 and list(r.json()) == ["error"], r.text


def test_the_timeout_parameter_is_checked_and_cannot_abandon_work(token_server):
    """tritonclient's `timeout=` (microseconds) is the caller's deadline: work a worker has not
    taken by then is not computed (504), work begun runs on to its end; either way no worker is
    stopped and replaced, which no client may cause at will."""
    x = torch.randn(3000, 8, 192).bfloat16()
    arrays = _arrays(x, x, x[..., :128].contiguous(), torch.tensor([0, 3000], dtype=torch.int32))
    restarts = sum(w["restarts"] for w in token_server.health()["workers"])
    slow = {"kernel": "reference", "causal": False}  # seconds of work
    with _triton(token_server) as c:
        with pytest.raises(InferenceServerException, match="not computed"):
            # 1 us: past before the body is in
            _infer(c, arrays, headers=TOKEN, timeout=1, parameters=slow)
        # 0.5 s: the idle worker takes it well before, and the work outlasts it
        result = _infer(c, arrays, headers=TOKEN, timeout=500_000, parameters=slow)
        assert result.as_numpy("out").shape == (3000, 8, 128)
        assert sum(w["restarts"] for w in token_server.health()["workers"]) == restarts
        with pytest.raises(InferenceServerException, match="timeout: expected microseconds"):
            _infer(c, arrays, headers=TOKEN, timeout=-1)
        _assert_healthy(token_server, c, headers=TOKEN)
