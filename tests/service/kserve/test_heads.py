"""Request heads of millions of entries on a real server, written by hand (tritonclient would
build them for minutes): a tensor shape of 16M dimensions and a parameters map of 1.5M entries
over gRPC, a 16 MiB JSON head of one huge array over HTTP. Each is refused from its counts on
the wire, before Python objects are made of it: the server's peak resident memory grows by the
message and little more, and a legitimate call made meanwhile is answered as the library
answers it. Each test prints what it measured."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import httpx
import pytest
import torch
from tritonclient.grpc import InferenceServerClient
from tritonclient.http import InferenceServerClient as HttpClient
from tritonclient.http import InferInput as HttpInput

from bench._server import free_port
from tests.batches import BatchSpec, make_batch
from tests.processes import rss
from tests.service.grpc_caller import grpc_inputs
from tests.service.protobuf_bytes import field, varint
from tests.service.servers import Server, serve, server_fixture
from tests.service.v2_tensors import to_numpy, to_torch
from zen_mla import ragged_attention

pytestmark = pytest.mark.slow

T = TypeVar("T")
MIB = 1 << 20
INFER = "/inference.GRPCInferenceService/ModelInfer"
#: what the server may grow by beyond the message's own bytes (held by grpc's transport, by the
#: read body, by the head split off the raw contents)
SLACK = 64 * MIB


@server_fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("heads")
    with serve(
        tmp,
        grpc_port=free_port(),
        workers=1,
        max_body_bytes=64 * MIB,
        # a gRPC call is charged three times the message limit before its message is read:
        # room for the attacker's call and the legitimate one beside it, from the same address
        max_inflight_bytes=512 * MIB,
    ) as s:
        yield s


def _peak_reset(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to VmRSS


def _peak(pid: int) -> int:
    """Process `pid`'s peak resident memory since `_peak_reset`, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


# -- protobuf written by hand ------------------------------------------------------------------


def _tensor(name: bytes, datatype: bytes, shape: bytes) -> bytes:
    """An InferInputTensor whose packed shape is `shape` (varints)."""
    return field(1, name) + field(2, datatype) + field(3, shape)


def _message(*fields: bytes) -> bytes:
    return field(1, b"mla_prefill") + b"".join(fields)


def _batch() -> tuple[torch.Tensor, ...]:
    return make_batch(BatchSpec([48, 16]), (2, 192, 128), torch.bfloat16)


def _served_grpc(server: Server) -> None:
    q, k, v, q_cu, _ = _batch()
    named = {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}
    with InferenceServerClient(server.grpc_target) as c:
        result = c.infer("mla_prefill", grpc_inputs(named))
    assert torch.equal(to_torch(result.as_numpy("out")), ragged_attention(q, k, v, q_cu))


def _served_http(server: Server) -> None:
    q, k, v, q_cu, _ = _batch()
    inputs = []
    for name, t in {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}.items():
        a = to_numpy(t)
        entry = HttpInput(name, list(a.shape), "BF16" if t.dtype == torch.bfloat16 else "INT32")
        entry.set_data_from_numpy(a, binary_data=True)
        inputs.append(entry)
    with HttpClient(server.url.removeprefix("http://")) as c:
        result = c.infer("mla_prefill", inputs)
    assert torch.equal(to_torch(result.as_numpy("out")), ragged_attention(q, k, v, q_cu))


def _shape_16m_dims() -> bytes:
    return _message(field(5, _tensor(b"q", b"BF16", b"\0" * 16_000_000)))


def _parameters_1_5m_entries() -> bytes:
    """q's parameters map of 1.5M entries (keys of 6 bytes, no values): one field of the
    request, inside one of its inputs."""
    entry = varint(4 << 3 | 2) + varint(8) + varint(1 << 3 | 2) + varint(6)
    params = b"".join(entry + b"%06x" % i for i in range(1_500_000))
    return _message(field(5, field(1, b"q") + field(2, b"BF16") + params))


#: how each message is made (not at collection), and what its refusal says
GRPC_HEADS = {
    "shape_16M_dims": (_shape_16m_dims, "q.shape: expected at most 8 dimensions, got 16000000"),
    "parameters_1.5M_entries": (
        _parameters_1_5m_entries,
        "q.parameters: expected at most 32 entries, got more",
    ),
}


def _beside(refused: Callable[[], T], served: Callable[[], None]) -> tuple[T, float]:
    """`refused()` on a thread while `served()` runs here: its result and seconds."""

    def timed() -> tuple[T, float]:
        t = time.monotonic()
        return refused(), time.monotonic() - t

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(timed)
        served()
        return future.result()


@pytest.mark.parametrize("case", GRPC_HEADS.values(), ids=GRPC_HEADS.keys())
def test_a_huge_grpc_head_is_refused_from_its_counts(server, case):
    make, words = case
    message = make()
    pid = server.process.pid
    with grpc.insecure_channel(
        server.grpc_target, options=[("grpc.max_send_message_length", 64 * MIB)]
    ) as channel:
        infer = channel.unary_unary(INFER)

        def refused() -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as info:
                infer(message, timeout=60)
            return info.value

        _served_grpc(server)  # warm: the first call's own allocations are not the head's
        before = rss(pid)
        _peak_reset(pid)
        error, took = _beside(refused, lambda: _served_grpc(server))
        grown = _peak(pid) - before
    print(
        f"{len(message) / MIB:.1f} MiB message: {error.code().name} in {took:.2f} s, "
        f"peak RSS +{grown / MIB:.0f} MiB"
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (error.details() or "")
    assert grown < len(message) + SLACK


def _json_head(inputs: bytes) -> bytes:
    return b'{"inputs":[' + inputs + b"]}"


HTTP_HEADS = {
    "shape_8M_dims": (
        b'{"name":"q","datatype":"BF16","shape":[',
        b"0,",
        8_000_000,
        b"0]}",
        "q.shape: expected at most 8 dimensions, got 8000001",
    ),
    "data_8M_numbers": (
        b'{"name":"q_cu_seq_lens","datatype":"INT32","shape":[2],"data":[',
        b"0,",
        8_000_000,
        b"0]}",
        "q_cu_seq_lens.data: expected 2 numbers (INT32 [2]), got 8000001",
    ),
    "nested_5M_lists": (
        b'{"name":"q","datatype":"FP32","shape":[1,1,1],"data":[',
        b"[],",
        5_000_000,
        b"[]]}",
        "q.data: expected",
    ),
}


@pytest.mark.parametrize("case", HTTP_HEADS.values(), ids=HTTP_HEADS.keys())
def test_a_huge_json_head_is_refused_from_its_counts(server, case):
    start, repeated, times, end, words = case
    head = _json_head(start + repeated * times + end)
    pid = server.process.pid

    def refused() -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            return c.post("/v2/models/mla_prefill/infer", content=head)

    _served_http(server)
    before = rss(pid)
    _peak_reset(pid)
    r, took = _beside(refused, lambda: _served_http(server))
    grown = _peak(pid) - before
    print(
        f"{len(head) / MIB:.1f} MiB JSON head: {r.status_code} in {took:.2f} s, "
        f"peak RSS +{grown / MIB:.0f} MiB"
    )
    assert r.status_code == 422, r.text
    assert words in r.json()["error"]
    assert grown < len(head) + SLACK
