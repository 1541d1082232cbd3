"""End-to-end benchmark: the client's POST /prefill and the KServe v2 (Open Inference Protocol)
route POST /v2/models/mla_prefill/infer on loopback against in-process ragged_attention, and the
service's ingest/egress rates (egress as plain httpx and as PrefillClient read the answer), for
uvicorn's httptools and h11.

    .venv/bin/python bench/e2e.py [--reps 7]

Starts its own `zen-mla serve` processes on free loopback ports and stops them (the httptools
one with ZEN_MLA_SYSTEM_SHM=true). Prints Markdown tables (docs/benchmarks.md has them) and writes
bench/out/e2e.png. Columns of the main table, all paired and interleaved with in-process:

- tcp, uds: PrefillClient over loopback TCP / a Unix socket, the tensors in the body;
- shm: PrefillClient with the service's same-host regions (inputs copied in per call);
  shm empty(): the inputs built in the regions beforehand (`empty()`), sent without a copy;
- v2 binary: tritonclient.http with the binary tensor data extension (BF16 as
  ml_dtypes.bfloat16); timed: InferInput.set_data_from_numpy (tritonclient's copy of each
  input into the body, its counterpart of the client's encoding), infer() and as_numpy;
- v2 shm: tritonclient.http with the system shared memory extension, the inputs placed once in
  registered /dev/shm regions beforehand (like shm empty()), outputs written by the service to
  a registered region; timed: infer() and get_contents_as_numpy (views into the region);
- v2 grpc: tritonclient.grpc, the tensors as raw_input_contents of a ModelInferRequest on the
  same server's gRPC port; timed as v2 binary (set_data_from_numpy, infer(), as_numpy);
  grpc raw: the same message written around the arrays' bytes (its head by protobuf, each raw
  entry appended: no protobuf copy of the tensors on the client's side), on a plain grpc
  channel; the answer parsed by protobuf, its outputs viewed in place. What the service and
  the transport take, without tritonclient's copies.

Targets: gRPC within 1.10x of v2 binary on `mixed`, within 1.25x on one token.

The results of both v2 columns are handed back as torch views (bf16 out, fp32 lse), no copy.
"""

from __future__ import annotations

import os

# The in-process runs interleaved with the service's leave this process's OpenMP threads
# spinning after each call (the OpenMP runtime's default wait); on 2 cores they take the CPU
# from the service's workers and from the next in-process call alike (measured, one token:
# in-process 2.35 -> 0.55 ms and through the service 7.4 -> 5.2 ms with passive waiting). An
# orchestrator computes nothing on these cores, so the benchmark waits passively. Set before
# torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import signal
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import httpx
import ml_dtypes
import numpy as np
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype
from tritonclient.utils import shared_memory as triton_shm

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import _common as c
from _server import free_port, server_timing, start_server

import zen_mla
from service.kserve.grpc_wire import RAW_IN, _encode_varint
from zen_mla import wire
from zen_mla.client import PrefillClient

MODEL = "mla_prefill"
INPUTS = ("q", "k", "v", "q_cu_seq_lens", "kv_cu_seq_lens")
METHODS = ("tcp", "uds", "shm", "shm empty()", "v2 binary", "v2 shm", "v2 grpc", "grpc raw")
# as_numpy's arrays are views of the (read-only) response bytes; the torch views of them are
# only read
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def transfer(url: str, mib: int, direction: str, reps: int) -> tuple[float, float, float]:
    """(ingest GB/s as the server read it, egress GB/s read by httpx, egress GB/s read by
    PrefillClient) for a body or response of `mib` MiB whose attention is trivial: 1 query
    against many keys (ingest), many queries against one key (egress). Egress is the answer's
    bytes over what the call took past the server's ingest, queue and compute (its
    Server-Timing): the answer written, sent and read into the caller's tensors."""
    h, d = 16, 192
    tokens = (mib << 20) // (h * d * 2)
    if direction == "ingest":
        big = torch.zeros(tokens, h, d).bfloat16()
        tensors = {
            "q": big[:1],
            "k": big,
            "v": big[:, :, :128],
            "q_cu_seq_lens": torch.tensor([0, 1]),
            "kv_cu_seq_lens": torch.tensor([0, tokens]),
        }
    else:
        big = torch.zeros(tokens, h, d).bfloat16()
        one = torch.zeros(1, h, d).bfloat16()
        tensors = {
            "q": big,
            "k": one,
            "v": one,
            "q_cu_seq_lens": torch.tensor([0, tokens]),
            "kv_cu_seq_lens": torch.tensor([0, 1]),
        }
    header, chunks = wire.encode(tensors, {"causal": "false"})
    body = header + b"".join(bytes(ch) for ch in chunks)
    step = 256 << 10  # as PrefillClient sends: see SEND_PART in zen_mla/client/_base.py
    parts = [memoryview(body)[i : i + step] for i in range(0, len(body), step)]
    headers = {"Content-Type": "application/octet-stream"}
    ingest, egress, client_egress = [], [], []
    seen: dict[str, float] = {}
    client = PrefillClient(url, shared_memory=False, timeout=120)
    # the client's Server-Timing, seen through its httpx client's hook (a benchmark's reach)
    client._http[0].event_hooks["response"] = [lambda r: seen.update(server_timing(r))]
    args = [tensors[n] for n in INPUTS]
    with httpx.Client(timeout=120) as raw, client:
        for _ in range(reps):
            t0 = time.perf_counter()
            r = raw.post(
                url + "/prefill",
                content=iter(parts),
                headers=headers | {"Content-Length": str(len(body))},
            )
            wall = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            st = server_timing(r)
            ingest.append(len(body) / st["ingest"] / 1e9)
            rest = wall - st["ingest"] - st["queue"] - st["compute"]
            egress.append(len(r.content) / max(rest, 1e-9) / 1e9)
            del r
            t0 = time.perf_counter()
            out = client.prefill(*args, causal=False)
            assert isinstance(out, torch.Tensor)
            wall = time.perf_counter() - t0
            rest = wall - seen["ingest"] - seen["queue"] - seen["compute"]
            client_egress.append(out.nbytes / max(rest, 1e-9) / 1e9)
            del out  # as a caller does once it has used the answer
    return statistics.median(ingest), statistics.median(egress), statistics.median(client_egress)


def to_numpy(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy view of `t`; bf16 as ml_dtypes.bfloat16, which tritonclient sends as BF16."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(a: np.ndarray[Any, Any]) -> torch.Tensor:
    """A torch view of `a`, as PrefillClient returns its results (bf16 out, fp32 lse)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def output_names(params: dict[str, Any]) -> tuple[str, ...]:
    return ("out", "lse") if params["return_lse"] else ("out",)


def v2_binary(
    client: Any, arrays: dict[str, np.ndarray[Any, Any]], params: dict[str, Any]
) -> tuple[torch.Tensor, ...]:
    """POST /v2/models/mla_prefill/infer, the tensors as binary data after the JSON."""
    inputs = []
    for name, a in arrays.items():
        x = triton.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        x.set_data_from_numpy(a, binary_data=True)
        inputs.append(x)
    names = output_names(params)
    outputs = [triton.InferRequestedOutput(n, binary_data=True) for n in names]
    result = client.infer(MODEL, inputs, outputs=outputs, parameters=params)
    return tuple(to_torch(result.as_numpy(n)) for n in names)


def v2_grpc(
    client: Any, arrays: dict[str, np.ndarray[Any, Any]], params: dict[str, Any]
) -> tuple[torch.Tensor, ...]:
    """ModelInfer over gRPC, the tensors as raw_input_contents."""
    inputs = []
    for name, a in arrays.items():
        x = triton_grpc.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        x.set_data_from_numpy(a)
        inputs.append(x)
    names = output_names(params)
    outputs = [triton_grpc.InferRequestedOutput(n) for n in names]
    result = client.infer(MODEL, inputs, outputs=outputs, parameters=params)
    return tuple(to_torch(result.as_numpy(n)) for n in names)


class GrpcRaw:
    """ModelInfer on a plain grpc channel, the message written around the arrays' bytes."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(
            target,
            options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
        )
        self.call = self.channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            response_deserializer=pb.ModelInferResponse.FromString,
        )

    def infer(
        self, arrays: dict[str, np.ndarray[Any, Any]], params: dict[str, Any]
    ) -> tuple[torch.Tensor, ...]:
        request = pb.ModelInferRequest(model_name=MODEL)
        for key, value in params.items():
            request.parameters[key].bool_param = value
        raws = []
        for name, a in arrays.items():
            request.inputs.add(name=name, datatype=np_to_triton_dtype(a.dtype), shape=a.shape)
            raws.append(a.view(np.uint8).reshape(-1).data)
        tag = bytes([RAW_IN << 3 | 2])
        parts: list[Any] = [request.SerializeToString()]
        for raw in raws:
            parts += [tag, _encode_varint(raw.nbytes), raw]
        response = self.call(b"".join(parts), timeout=600)
        got = []
        for out, raw in zip(response.outputs, response.raw_output_contents, strict=True):
            a = np.frombuffer(raw, triton_to_np_dtype(out.datatype)).reshape(list(out.shape))
            got.append(to_torch(a))
        return tuple(got)

    def close(self) -> None:
        self.channel.close()


def _packed(sizes: list[int], align: int = 64) -> tuple[list[int], int]:
    """Offsets of consecutive `sizes`-byte tensors in one region, each `align`ed; its size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // align) * align
    return offsets, max(end, align)


class V2Shm:
    """One batch's tensors in system shared memory: the inputs placed once in a region, one
    region for the outputs, both registered with the service; `infer` names them. A context
    manager: the regions are unregistered and destroyed on exit."""

    def __init__(
        self,
        client: Any,
        tag: str,
        arrays: dict[str, np.ndarray[Any, Any]],
        params: dict[str, Any],
    ) -> None:
        self.client, self.params = client, params
        self.regions: list[tuple[str, Any]] = []
        base = f"zen_mla_bench_{os.getpid()}_{tag}"
        self.in_name, self.out_name = f"{base}_in", f"{base}_out"
        try:
            offsets, size = _packed([a.nbytes for a in arrays.values()])
            handle = self._region(self.in_name, size)
            self.inputs: list[tuple[str, list[int], str, int, int]] = []
            for (name, a), offset in zip(arrays.items(), offsets, strict=True):
                triton_shm.set_shared_memory_region(handle, [a], offset=offset)
                dtype = np_to_triton_dtype(a.dtype)
                self.inputs.append((name, list(a.shape), dtype, offset, a.nbytes))
            tq, h = arrays["q"].shape[:2]
            dv = arrays["v"].shape[2]
            want = {"out": tq * h * dv * 2, "lse": h * tq * 4}  # bf16 [Tq, H, Dv], fp32 [H, Tq]
            names = output_names(params)
            offsets, size = _packed([want[n] for n in names])
            self.out_handle = self._region(self.out_name, size)
            self.outputs = {n: (offset, want[n]) for n, offset in zip(names, offsets, strict=True)}
        except BaseException:
            self.close()
            raise

    def _region(self, name: str, size: int) -> Any:
        handle = triton_shm.create_shared_memory_region(name, "/" + name, size, create_only=True)
        self.regions.append((name, handle))
        self.client.register_system_shared_memory(name, "/" + name, size)
        return handle

    def infer(self) -> tuple[torch.Tensor, ...]:
        """The request naming the regions, and views of the outputs the service wrote there
        (valid until the next request)."""
        inputs = []
        for name, shape, dtype, offset, nbytes in self.inputs:
            x = triton.InferInput(name, shape, dtype)
            x.set_shared_memory(self.in_name, nbytes, offset=offset)
            inputs.append(x)
        outputs = []
        for name, (offset, nbytes) in self.outputs.items():
            o = triton.InferRequestedOutput(name)
            o.set_shared_memory(self.out_name, nbytes, offset=offset)
            outputs.append(o)
        result = self.client.infer(MODEL, inputs, outputs=outputs, parameters=self.params)
        got = []
        for name, (offset, _) in self.outputs.items():
            meta = result.get_output(name)
            dtype = triton_to_np_dtype(meta["datatype"])
            a = triton_shm.get_contents_as_numpy(self.out_handle, dtype, meta["shape"], offset)
            got.append(to_torch(a))
        return tuple(got)

    def close(self) -> None:
        """Unregister and destroy every region, even when one of them fails. No view of the
        outputs may be alive (closing a mapping with views raises BufferError)."""
        with contextlib.ExitStack() as stack:
            while self.regions:
                name, handle = self.regions.pop(0)
                stack.callback(triton_shm.destroy_shared_memory_region, handle)
                stack.callback(self.client.unregister_system_shared_memory, name)

    def __enter__(self) -> V2Shm:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def check_same(name: str, want: object, *got: tuple[torch.Tensor, ...]) -> None:
    """The v2 routes' results are the /prefill route's (same server, same kernel), once per
    batch before timing: a fast wrong answer is no result."""
    ref = want if isinstance(want, tuple) else (want,)
    for g in got:
        assert len(g) == len(ref), f"{name}: {len(g)} outputs, want {len(ref)}"
        for r, t in zip(ref, g, strict=True):
            torch.testing.assert_close(t, r, msg=lambda m: f"{name}: {m}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    uds = f"/tmp/zen-mla-bench-{os.getpid()}.sock"
    grpc_port = free_port()
    servers = {
        "httptools": start_server(
            "httptools", system_shm=True, settings={"grpc_port": str(grpc_port)}
        )
    }
    try:
        servers["h11"] = start_server("h11")
        servers["uds"] = start_server("httptools", uds)
        rows: list[list[str]] = []
        ratios: dict[str, dict[str, float]] = {}
        url = servers["httptools"][1]
        with (
            PrefillClient(url, shared_memory=False) as tcp,
            PrefillClient(servers["uds"][1], uds=uds, shared_memory=False) as unix,
            PrefillClient(url, shared_memory=True) as shm,
            triton.InferenceServerClient(
                url.removeprefix("http://"), connection_timeout=60.0, network_timeout=600.0
            ) as v2,
            triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as grpc_client,
            contextlib.closing(GrpcRaw(f"127.0.0.1:{grpc_port}")) as raw,
        ):
            for name, spec in c.REFERENCE_BATCHES.items():
                x = c.make_inputs(spec)
                a = (x["q"], x["k"], x["v"], x["q_cu_seq_lens"], x["kv_cu_seq_lens"])
                # the same inputs built in the client's regions: sent without a copy
                z = tuple(shm.empty(t.shape, t.dtype).copy_(t) for t in a[:3]) + a[3:]
                kw: dict[str, Any] = {"causal": spec.causal, "return_lse": spec.return_lse}
                arrays = {n: to_numpy(x[n]) for n in INPUTS}  # views: converted once
                with V2Shm(v2, name, arrays, kw) as v2shm:
                    check_same(
                        name,
                        tcp.prefill(*a, **kw),
                        v2_binary(v2, arrays, kw),
                        v2shm.infer(),
                        v2_grpc(grpc_client, arrays, kw),
                        raw.infer(arrays, kw),
                    )
                    med = c.paired_medians(
                        {
                            "in-process": partial(zen_mla.ragged_attention, *a, **kw),
                            "tcp": partial(tcp.prefill, *a, **kw),
                            "uds": partial(unix.prefill, *a, **kw),
                            "shm": partial(shm.prefill, *a, **kw),
                            "shm empty()": partial(shm.prefill, *z, **kw),
                            "v2 binary": partial(v2_binary, v2, arrays, kw),
                            "v2 shm": v2shm.infer,
                            "v2 grpc": partial(v2_grpc, grpc_client, arrays, kw),
                            "grpc raw": partial(raw.infer, arrays, kw),
                        },
                        args.reps,
                    )
                base = med["in-process"]
                ratios[name] = {m: med[m] / base for m in METHODS}
                mib = sum(t.nbytes for t in x.values()) / 2**20
                rows.append(
                    [
                        name,
                        f"{mib:.0f}",
                        f"{base * 1e3:.2f}",
                        *(f"{med[m] * 1e3:.2f} ({med[m] / base:.2f})" for m in METHODS),
                    ]
                )
            one = c.make_inputs(c.RefBatch([1], [1], causal=True, return_lse=False))
            a1 = (one["q"], one["k"], one["v"], one["q_cu_seq_lens"], one["kv_cu_seq_lens"])
            kw1 = {"causal": True, "return_lse": False}
            arrays1 = {n: to_numpy(one[n]) for n in INPUTS}
            with V2Shm(v2, "one", arrays1, kw1) as v2shm1:
                check_same(
                    "one",
                    tcp.prefill(*a1),
                    v2_binary(v2, arrays1, kw1),
                    v2shm1.infer(),
                    v2_grpc(grpc_client, arrays1, kw1),
                    raw.infer(arrays1, kw1),
                )
                tiny = c.paired_medians(
                    {
                        "in-process": partial(zen_mla.ragged_attention, *a1),
                        "tcp": partial(tcp.prefill, *a1),
                        "uds": partial(unix.prefill, *a1),
                        "shm": partial(shm.prefill, *a1),
                        "v2 binary": partial(v2_binary, v2, arrays1, kw1),
                        "v2 shm": v2shm1.infer,
                        "v2 grpc": partial(v2_grpc, grpc_client, arrays1, kw1),
                        "grpc raw": partial(raw.infer, arrays1, kw1),
                    },
                    max(25, args.reps),
                )
        print("End to end (httptools), paired medians: ms (ratio to in-process)\n")
        header = ["batch", "body MiB", "in-process ms", *METHODS]
        print(c.table(header, rows))
        print("\nOne token (dispatch overhead), median ms\n")
        print(c.table(list(tiny), [[f"{t * 1e3:.2f}" for t in tiny.values()]]))
        grpc_rows = [
            [
                name,
                f"{r['v2 grpc'] / r['v2 binary']:.2f}",
                f"{r['grpc raw'] / r['v2 binary']:.2f}",
                "<= 1.10" if name == "mixed" else "",
            ]
            for name, r in ratios.items()
        ]
        grpc_rows.append(
            [
                "one token",
                f"{tiny['v2 grpc'] / tiny['v2 binary']:.2f}",
                f"{tiny['grpc raw'] / tiny['v2 binary']:.2f}",
                "<= 1.25",
            ]
        )
        print("\ngRPC over HTTP: time over v2 binary's\n")
        print(c.table(["batch", "v2 grpc", "grpc raw", "target"], grpc_rows))

        io_rows = []
        for http in ("httptools", "h11"):
            u = servers[http][1]
            for mib in (64, 256):
                ingest, _, _ = transfer(u, mib, "ingest", max(3, args.reps // 2))
                _, egress, client = transfer(u, mib, "egress", max(3, args.reps // 2))
                io_rows.append(
                    [http, f"{mib} MiB", f"{ingest:.2f}", f"{egress:.2f}", f"{client:.2f}"]
                )
        print("\nIngest (server reading the body into shared memory) and egress, GB/s\n")
        head = ["http", "size", "ingest GB/s", "egress GB/s (httpx)", "egress GB/s (client)"]
        print(c.table(head, io_rows))
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(uds)  # the service leaves its socket file behind
    plot(ratios, io_rows)


def plot(ratios: dict[str, dict[str, float]], io_rows: list[list[str]]) -> None:
    """Left: each batch's time per method over in-process (grouped bars, one colour per
    method); right: ingest and egress rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c.OUT_DIR.mkdir(exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(18, 4.5), width_ratios=(3, 1))
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        xs_m = [b + (i - (len(METHODS) - 1) / 2) * width for b in range(len(ratios))]
        left.bar(xs_m, [r[method] for r in ratios.values()], width, label=method)
    left.set_xticks(range(len(ratios)), list(ratios))
    left.axhline(1.0, color="black", linewidth=0.8)
    left.axhline(1.1, color="tab:red", linestyle="--", linewidth=0.8, label="shm target 1.1")
    left.set_ylabel("e2e / in-process time (lower is better)")
    left.legend(fontsize=8, ncols=2)
    labels = [f"{r[0]}\n{r[1]}" for r in io_rows]
    xs = range(len(io_rows))
    for j, label in enumerate(("ingest", "egress (httpx)", "egress (PrefillClient)")):
        bars = [float(r[2 + j]) for r in io_rows]
        right.bar([x + (j - 1) * 0.27 for x in xs], bars, 0.27, label=label)
    right.set_xticks(list(xs), labels)
    right.set_ylabel("GB/s")
    right.legend()
    fig.tight_layout()
    path = c.OUT_DIR / "e2e.png"
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
