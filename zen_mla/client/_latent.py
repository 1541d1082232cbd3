"""Calls over MLA's latent cache, as the twins make them: the weights a client registers
(`Weights`: kept here by name, registered with each endpoint the first time a call takes one
there, and again where the endpoint answers that it has none: a restarted service), and the
latent request, sent as a safetensors `/prefill` naming its weight, or on the region socket
where the endpoint offers one (the weight registered there from a region: on the socket the
caller is the user, or the hello's tenant, not the peer's address as over HTTP, so each way
holds its own registration)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from .. import wire
from ..errors import InvalidInputError
from ..wire.dtypes import BY_SAFETENSORS, BY_TORCH
from ._answers import AnswerSpec, Bytes, problem
from ._endpoints import Endpoint, weigh

__all__ = ["HTTP", "MAX_REGISTER_ANSWER", "SOCKET", "Way", "Weights", "check_latent", "registered"]

#: of a registration's JSON answer
MAX_REGISTER_ANSWER = 64 << 10
#: the ways a weight is registered with an endpoint
HTTP, SOCKET = "http", "socket"
Way = str


class Weights:
    """The weights a client registered, by name, and the names each endpoint holds, by the way
    they were registered there (`HTTP`, `SOCKET`). One lock guards both (any thread of the sync
    twin's callers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tensors: dict[str, torch.Tensor] = {}
        self._held: dict[tuple[Endpoint[Any], Way], set[str]] = {}

    def add(self, name: str, w_kv_b: torch.Tensor) -> None:
        """`w_kv_b` as the weight `name` from now on (a CPU copy where it is not one)."""
        wire.check_weight_name("name", name)
        if not isinstance(w_kv_b, torch.Tensor):
            raise InvalidInputError("w_kv_b", "a torch.Tensor", type(w_kv_b).__name__)
        if w_kv_b.ndim != 2 or w_kv_b.dtype not in BY_TORCH or min(w_kv_b.shape) < 1:
            raise InvalidInputError(
                "w_kv_b",
                "[H * (qk_nope_dim + v_head_dim), kv_lora_rank] (kv_b_proj's weight, out x in)",
                f"{list(w_kv_b.shape)} {w_kv_b.dtype}",
            )
        tensor = w_kv_b.detach().to("cpu").contiguous()
        with self._lock:
            self._tensors[name] = tensor
            for names in self._held.values():
                names.discard(name)  # registered again where a call next takes it

    def tensor(self, name: str) -> torch.Tensor:
        with self._lock:
            found = self._tensors.get(name)
        if found is None:
            raise InvalidInputError(
                "weight", "the name of a weight this client registered (register_weight)", name
            )
        return found

    def drop(self, name: str) -> list[tuple[Endpoint[Any], Way]]:
        """Forget `name` here; the endpoints that hold it, and by which way, to be told."""
        with self._lock:
            if self._tensors.pop(name, None) is None:
                raise InvalidInputError("name", "a weight this client registered", repr(name))
            holding = [key for key, names in self._held.items() if name in names]
            for key in holding:
                self._held[key].discard(name)
        return holding

    def held(self, ep: Endpoint[Any], name: str, way: Way = HTTP) -> bool:
        with self._lock:
            return name in self._held.get((ep, way), ())

    def mark(self, ep: Endpoint[Any], name: str, held: bool, way: Way = HTTP) -> None:
        with self._lock:
            names = self._held.setdefault((ep, way), set())
            if held:
                names.add(name)
            else:
                names.discard(name)

    def put(
        self, name: str, token_headers: dict[str, str]
    ) -> tuple[str, list[bytes | memoryview], dict[str, str]]:
        """The registration's path, body parts and headers."""
        header, chunks = wire.encode({"w_kv_b": self.tensor(name)})
        length = len(header) + sum(c.nbytes for c in chunks)
        headers = token_headers | {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(length),
        }
        return f"/weights/{name}", [header, *chunks], headers


def registered(status: int, body: Bytes, headers: Any) -> None:
    """A registration's answer: 200, or the service's error raised."""
    if status != 200:
        raise problem(status, body, headers)


def check_latent(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    q_cu_seq_lens: torch.Tensor,
    kv_cu_seq_lens: torch.Tensor | None,
    w_kv_b: torch.Tensor,
    *,
    causal: bool,
    return_lse: bool,
) -> tuple[dict[str, torch.Tensor], AnswerSpec, int]:
    """The request's tensors by name, what its answer must hold, and its weight for balancing:
    q 3-D, kv_c and k_pe 2-D, cu_seq_lens 1-D integers, dtypes the wire carries (the service
    checks the rest, naming the tensor)."""
    tensors = {"q": q, "kv_c": kv_c, "k_pe": k_pe, "q_cu_seq_lens": q_cu_seq_lens}
    if kv_cu_seq_lens is not None:
        tensors["kv_cu_seq_lens"] = kv_cu_seq_lens
    dims = {"q": 3, "kv_c": 2, "k_pe": 2, "q_cu_seq_lens": 1, "kv_cu_seq_lens": 1}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(name, "a torch.Tensor", type(t).__name__)
        offsets = name.endswith("cu_seq_lens")
        dtypes = (torch.int32, torch.int64) if offsets else tuple(BY_TORCH)
        if t.ndim != dims[name] or t.dtype not in dtypes or (offsets and t.shape[0] < 1):
            among = "int32 or int64" if offsets else f"a dtype among {', '.join(BY_SAFETENSORS)}"
            raise InvalidInputError(
                name, f"a {dims[name]}-D tensor, {among}", f"{t.dtype} of shape {tuple(t.shape)}"
            )
    tq, heads, dqk = (int(n) for n in q.shape)
    dv = int(w_kv_b.shape[0]) // max(heads, 1) - (dqk - int(k_pe.shape[1]))
    want: dict[str, tuple[tuple[int, ...], str]] = {
        "out": ((tq, heads, dv), BY_TORCH[q.dtype].safetensors)
    }
    if return_lse:
        want["lse"] = ((heads, tq), "F32")
    work = weigh(q, q_cu_seq_lens, kv_cu_seq_lens, causal)
    return tensors, AnswerSpec(want), work
