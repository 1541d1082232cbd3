"""Same-host region clients for the service tests: a request laid out in a region, and a
legitimate client's round (hello, register, prefill through regions) timed (attacks.during runs
it beside an attack)."""

from __future__ import annotations

import mmap
import os
import time

import httpx
import torch

from tests.reference import assert_close_to_reference
from tests.service.servers import Server
from zen_mla.regions.connection import ClientRegion, RegionConnection
from zen_mla.wire import regions_json as rr
from zen_mla.wire.dtypes import BY_TORCH

REGION_JSON = {"Content-Type": rr.MEDIA_TYPE}


def region_socket(server: Server) -> str:
    offer = server.health()["shared_memory"]
    assert offer and os.path.exists(offer["socket"]), offer
    assert (os.stat(offer["socket"]).st_mode & 0o777) == 0o600
    return str(offer["socket"])


class SharedMemfd:
    """A memfd of this process's, mapped here, registered by hand (`handle`) on any connection;
    tensors and places in it as a ClientRegion's."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.handle = ""

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = dtype.itemsize * int(torch.Size(shape).numel())
        return self.bytes[offset : offset + n].view(dtype).view(*shape)

    def place(self, offset: int, t: torch.Tensor) -> rr.TensorPlace:
        return rr.TensorPlace(self.handle, offset, BY_TORCH[t.dtype].safetensors, tuple(t.shape))


def lay_out(region: ClientRegion | SharedMemfd, tokens: int, lse: bool):
    """q, k, v, cu and out (and lse) laid out one after another in `region`, filled: their
    places, and (q, k, v, cu, out) as tensors."""
    h, dqk, dv = 2, 64, 32
    q = region.tensor(0, (tokens, h, dqk), torch.float32)
    k = region.tensor(q.nbytes, (tokens, h, dqk), torch.float32)
    v = region.tensor(2 * q.nbytes, (tokens, h, dv), torch.float32)
    off = 2 * q.nbytes + v.nbytes
    cu = region.tensor(off, (2,), torch.int64)
    out = region.tensor(off + 64, (tokens, h, dv), torch.float32)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape))
    cu.copy_(torch.tensor([0, tokens]))
    places = {
        "q": region.place(0, q),
        "k": region.place(q.nbytes, k),
        "v": region.place(2 * q.nbytes, v),
        "q_cu_seq_lens": region.place(off, cu),
        "out": region.place(off + 64, out),
    }
    if lse:
        lse_t = region.tensor(off + 64 + out.nbytes, (h, tokens), torch.float32)
        places["lse"] = region.place(off + 64 + out.nbytes, lse_t)
    return places, (q, k, v, cu, out)


def post_places(
    server: Server, places: dict, meta: dict | None = None, token: str | None = None
) -> httpx.Response:
    headers = REGION_JSON | ({"Authorization": f"Bearer {token}"} if token else {})
    with server.client() as c:
        return c.post("/prefill", content=rr.encode(places, meta), headers=headers)


def legit_round(server: Server, path: str, token: str | None) -> float:
    """Seconds for a client with the token to say hello, register a region and have a prefill
    through it answered correctly."""
    t0 = time.monotonic()
    client = RegionConnection(path, token, timeout=15)
    try:
        places, (q, k, v, cu, out) = lay_out(ClientRegion(client, 1 << 20), 64, lse=False)
        r = post_places(server, places, token=token)
        assert r.status_code == 200, r.text
        assert_close_to_reference(q, k, v, cu, None, True, out)
    finally:
        client.close()
    return time.monotonic() - t0
