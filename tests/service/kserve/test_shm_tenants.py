"""System shared memory between two tenants of one real server (`zen-mla serve --system-shm`,
a tenants file), over HTTP (`tritonclient.http`) and over gRPC (`tritonclient.grpc`): bob tries
what an attacker holding a token of his own would (list alice's regions, read them, write them,
register her object, unregister her regions) and is told what he would be told of a name never
registered, or 403 for her object; alice's answers, the library's own, are checked before,
between and after."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException, np_to_triton_dtype
from tritonclient.utils import shared_memory as shm

import zen_mla
from bench._server import free_port
from tests.batches import BatchSpec, make_batch
from tests.service.servers import Server, serve, server_fixture
from tests.service.v2_tensors import to_numpy, to_torch

pytestmark = pytest.mark.slow

MODEL = "mla_prefill"
MLA = (2, 192, 128)
TOKENS = {"alice": "al1ce-token", "bob": "b0b-token"}
#: the status each protocol answers a refusal with
CODES = {
    "http": {"forbidden": "403", "not_found": "404", "invalid": "422"},
    "grpc": {
        "forbidden": "StatusCode.PERMISSION_DENIED",
        "not_found": "StatusCode.NOT_FOUND",
        "invalid": "StatusCode.INVALID_ARGUMENT",
    },
}


@server_fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("shm_tenants")
    tenants = tmp / "tenants"
    tenants.write_text("".join(f"{name} {token}\n" for name, token in TOKENS.items()))
    with serve(tmp, grpc_port=free_port(), system_shm=True, workers=1, tenants_file=tenants) as s:
        yield s


@dataclass
class Caller:
    """One tenant's tritonclient over one protocol, its bearer token on every call."""

    protocol: str  # "http" or "grpc"
    client: Any
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    @property
    def module(self) -> Any:
        return triton_http if self.protocol == "http" else triton_grpc

    def status(self, name: str = "") -> dict[str, str]:
        """The regions this caller is shown: name -> key."""
        got = self.client.get_system_shared_memory_status(name, headers=self.headers)
        if self.protocol == "http":
            return {r["name"]: r["key"] for r in got}
        return {n: r.key for n, r in got.regions.items()}

    def register(self, name: str, key: str, nbytes: int) -> None:
        self.client.register_system_shared_memory(name, key, nbytes, headers=self.headers)

    def unregister(self, name: str = "") -> None:
        self.client.unregister_system_shared_memory(name, headers=self.headers)

    def infer(self, inputs: list[Any], outputs: list[Any] | None = None) -> Any:
        return self.client.infer(MODEL, inputs, outputs=outputs, headers=self.headers)

    def tensor(self, name: str, a: np.ndarray, region: str | None = None, at: int = 0) -> Any:
        """An input: `a` as binary data, or (`region`) lying `at` bytes into that region."""
        i = self.module.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        if region is None:
            i.set_data_from_numpy(a)
        else:
            i.set_shared_memory(region, a.nbytes, offset=at)
        return i

    def out_to(self, region: str, nbytes: int, at: int) -> Any:
        out = self.module.InferRequestedOutput("out")
        out.set_shared_memory(region, nbytes, offset=at)
        return out

    def refused(self, call: Callable[[], object], kind: str, *fragments: str) -> str:
        """`call` fails with the protocol's status for `kind`, its message holding each
        fragment (regular expressions); the message."""
        with pytest.raises(InferenceServerException) as info:
            call()
        status, message = str(info.value.status()), str(info.value.message())
        assert status == CODES[self.protocol][kind], (status, message)
        for part in fragments:
            assert re.search(part, message), (part, message)
        return message


def callers(server: Server, protocol: str) -> tuple[Caller, Caller]:
    """alice and bob over `protocol`."""
    made = []
    for name in ("alice", "bob"):
        if protocol == "http":
            client: Any = triton_http.InferenceServerClient(urlparse(server.url).netloc)
        else:
            client = triton_grpc.InferenceServerClient(server.grpc_target)
        made.append(Caller(protocol, client, TOKENS[name]))
    return made[0], made[1]


@dataclass
class Workspace:
    """One tenant's /dev/shm object holding a batch's inputs one after another (64-byte
    aligned) and room for `out` after them; unlinked on `close`."""

    tensors: dict[str, torch.Tensor]
    key: str = field(init=False)
    handle: Any = field(init=False)
    offsets: dict[str, int] = field(init=False, default_factory=dict)
    out_at: int = field(init=False)
    size: int = field(init=False)

    def __post_init__(self) -> None:
        at = 0
        arrays = self.arrays()
        for name, a in arrays.items():
            self.offsets[name] = at
            at += -(-a.nbytes // 64) * 64
        self.out_at, self.size = at, at + self.out_bytes
        self.key = f"/zen_mla_tenants_{uuid.uuid4().hex[:12]}"
        self.handle = shm.create_shared_memory_region(self.key, self.key, self.size)
        for name, a in arrays.items():
            shm.set_shared_memory_region(self.handle, [a], offset=self.offsets[name])

    def arrays(self) -> dict[str, np.ndarray]:
        return {n: to_numpy(t) for n, t in self.tensors.items()}

    @property
    def out_bytes(self) -> int:
        q, v = self.tensors["q"], self.tensors["v"]
        return q.shape[0] * v.shape[1] * v.shape[2] * v.element_size()

    def bytes(self) -> bytes:
        return Path("/dev/shm", self.key.lstrip("/")).read_bytes()

    def out(self) -> torch.Tensor:
        q, v = self.tensors["q"], self.tensors["v"]
        shape = [q.shape[0], v.shape[1], v.shape[2]]
        dtype = to_numpy(torch.zeros(1, dtype=v.dtype)).dtype
        return to_torch(np.array(shm.get_contents_as_numpy(self.handle, dtype, shape, self.out_at)))

    def inputs(self, caller: Caller, region: str) -> list[Any]:
        """Every input named where it lies in `region` (this object registered whole)."""
        return [caller.tensor(n, a, region, self.offsets[n]) for n, a in self.arrays().items()]

    def reference(self) -> torch.Tensor:
        t = self.tensors
        return zen_mla.ragged_attention(t["q"], t["k"], t["v"], t["q_cu_seq_lens"])

    def close(self) -> None:
        shm.destroy_shared_memory_region(self.handle)


def batch(seed: int) -> dict[str, torch.Tensor]:
    q, k, v, q_cu, _ = make_batch(BatchSpec([24, 40]), MLA, torch.bfloat16, seed=seed)
    return {"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}


def served(alice: Caller, mine: Workspace) -> None:
    """alice's call: inputs from her region `io`, `out` into it; the library's answer there,
    and her region listed as hers."""
    shm.set_shared_memory_region(mine.handle, [np.zeros(mine.out_bytes, np.uint8)], mine.out_at)
    alice.infer(mine.inputs(alice, "io"), [alice.out_to("io", mine.out_bytes, mine.out_at)])
    assert torch.equal(mine.out(), mine.reference())
    assert alice.status() == {"io": mine.key}
    assert alice.status("io") == {"io": mine.key}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_tenant_cannot_list_read_write_take_or_unregister_another_s_regions(
    server: Server, protocol: str
):
    alice, bob = callers(server, protocol)
    mine, his = Workspace(batch(seed=1)), Workspace(batch(seed=2))
    try:
        alice.register("io", mine.key, mine.size)
        served(alice, mine)

        # list: none of hers, and her name answered as a name never registered
        assert bob.status() == {}
        never = bob.refused(lambda: bob.status("never"), "not_found", "'never'")
        told = bob.refused(lambda: bob.status("io"), "not_found")
        assert told == never.replace("'never'", "'io'")

        # read: her request as his own, then only q from her region beside his inputs
        unknown = "shared_memory_region: expected a registered region name, got 'io'"
        bob.refused(lambda: bob.infer(mine.inputs(bob, "io")), "invalid", "^q." + unknown)
        arrays = his.arrays()
        mixed = [bob.tensor(n, a) for n, a in arrays.items() if n != "q"]
        mixed.append(bob.tensor("q", arrays["q"], "io", mine.offsets["q"]))
        bob.refused(lambda: bob.infer(mixed), "invalid", "^q." + unknown)

        # write: his answer into her region, over her out and over her q
        before = mine.bytes()
        own = [bob.tensor(n, a) for n, a in arrays.items()]
        for at in (mine.out_at, mine.offsets["q"]):
            out = bob.out_to("io", his.out_bytes, at)
            bob.refused(lambda out=out: bob.infer(own, [out]), "invalid", "^out." + unknown)
        assert mine.bytes() == before

        # take: her object registered as his, by its key with and without the slash
        for key in (mine.key, mine.key.lstrip("/")):
            bob.refused(
                lambda key=key: bob.register("stolen", key, mine.size),
                "forbidden",
                "registered by another tenant",
            )

        # unregister: her name, then all of his
        bob.unregister("io")
        bob.unregister()
        served(alice, mine)

        # his own region under her name: two names, each tenant its own
        bob.register("io", his.key, his.size)
        assert bob.status() == {"io": his.key}
        bob.infer(his.inputs(bob, "io"), [bob.out_to("io", his.out_bytes, his.out_at)])
        assert torch.equal(his.out(), his.reference())
        shm.set_shared_memory_region(his.handle, [np.full(his.out_at, 0xFF, np.uint8)], 0)
        served(alice, mine)
        bob.unregister()
        served(alice, mine)
        assert server.health()["status"] == "ok"
    finally:
        for caller in (alice, bob):
            caller.unregister()
            caller.client.close()
        mine.close()
        his.close()
