"""A client's side of same-host shared memory: its connection to a service's region socket, the
regions it registered there, and each request laid out in them.

Scratch regions hold a request's inputs (one copy, straight from the caller's tensors, also from
CUDA) and its outputs; they are reused across calls and replaced by larger ones when a request
does not fit. `empty()` gives a tensor in a region of its own, which a request then names where
it lies, without a copy; the region is unregistered once the tensor is gone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._errors import BY_STATUS, ZenMLAError
from ._memfd import create_sealed_memfd
from ._region_wire import recv_frame, send_frame
from .region_request import TensorPlace
from .wire import NAMES

__all__ = ["ClientRegion", "RegionClient", "RegionSet", "SharedMemoryUnavailableError"]

ALIGN = 64
MIN_SCRATCH = 16 << 20


class SharedMemoryUnavailableError(Exception):
    """Shared memory cannot be had from this service (the message says why)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RegionClient:
    """One connection to one service's region socket; one request at a time (a lock)."""

    def __init__(self, path: str, token: str | None, timeout: float = 10.0) -> None:
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
            self.hello = self._call({"op": "hello", "token": token or ""})
        except (OSError, ZenMLAError) as exc:
            self._sock.close()
            raise SharedMemoryUnavailableError(f"region socket {path}: {exc}") from exc

    def _call(self, message: dict[str, Any], fd: int | None = None) -> dict[str, Any]:
        with self._lock:
            send_frame(self._sock, message, fd)
            reply = recv_frame(self._sock)
        if not reply.get("ok"):
            status = int(reply.get("status", 500))
            raise BY_STATUS.get(status, ZenMLAError)(str(reply.get("error")))
        return reply

    def register(self, fd: int) -> str:
        return str(self._call({"op": "register"}, fd)["region"])

    def unregister(self, handle: str) -> None:
        with contextlib.suppress(OSError, ZenMLAError):
            self._call({"op": "unregister", "region": handle})

    def close(self) -> None:
        self._sock.close()  # the service drops every region of this connection


class ClientRegion:
    """A registered memfd, mapped here."""

    def __init__(self, client: RegionClient, nbytes: int) -> None:
        fd = create_sealed_memfd(nbytes)
        try:
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            self.handle = client.register(fd)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.base = self.bytes.data_ptr()
        _pin(self)

    def tensor(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = dtype.itemsize
        for d in shape:
            n *= d
        return self.bytes[offset : offset + n].view(dtype).view(*shape)

    def place(self, offset: int, t: torch.Tensor) -> TensorPlace:
        return TensorPlace(self.handle, offset, NAMES[t.dtype], tuple(t.shape))

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where `t` lies in this region, if it is a contiguous CPU tensor inside it."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        start = t.data_ptr()
        if self.base <= start and start + t.numel() * t.element_size() <= self.base + self.nbytes:
            return start - self.base
        return None


def _pin(region: ClientRegion) -> None:
    """Where CUDA is, register the mapping as pinned host memory: copies between the device and
    the region then run at DMA speed instead of through a bounce buffer."""
    if not torch.cuda.is_available():
        return
    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    cudart.cudaHostRegister(region.base, region.nbytes, 0)
    weakref.finalize(region, cudart.cudaHostUnregister, region.base)


@dataclass
class Layout:
    """A request laid out in a scratch region: places of every tensor, and the outputs' views."""

    places: dict[str, TensorPlace]
    out: torch.Tensor
    lse: torch.Tensor | None


class RegionSet:
    """The regions a client holds in one service."""

    def __init__(self, client: RegionClient) -> None:
        self.client = client
        self._lock = threading.Lock()  # guards the lists below
        self._free: list[ClientRegion] = []
        self._own: list[ClientRegion] = []  # behind empty() tensors
        self._gone: list[str] = []  # handles of empty() regions whose tensor was collected

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in a region of its own: a request that names it sends no copy of it."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        region = ClientRegion(self.client, max(_aligned(n), ALIGN))
        t = region.tensor(0, shape, dtype)
        with self._lock:
            self._own.append(region)
        weakref.finalize(t, self._collected, region.handle)
        return t

    def _collected(self, handle: str) -> None:
        with self._lock:
            self._gone.append(handle)

    def _forget_collected(self) -> None:
        with self._lock:
            gone, self._gone = self._gone, []
            self._own = [r for r in self._own if r.handle not in gone]
        for handle in gone:
            self.client.unregister(handle)

    def where(self, t: torch.Tensor) -> TensorPlace | None:
        with self._lock:
            regions = list(self._own)
        for region in regions:
            offset = region.offset_of(t)
            if offset is not None:
                return region.place(offset, t)
        return None

    @contextlib.contextmanager
    def scratch(self, nbytes: int) -> Iterator[ClientRegion]:
        """A scratch region of at least `nbytes`, this caller's until the block ends."""
        self._forget_collected()
        with self._lock:
            fits = [r for r in self._free if r.nbytes >= nbytes]
            region = min(fits, key=lambda r: r.nbytes) if fits else None
            if region is not None:
                self._free.remove(region)
        if region is None:
            region = ClientRegion(self.client, max(MIN_SCRATCH, _aligned(nbytes) * 5 // 4))
        try:
            yield region
        finally:
            with self._lock:
                self._free.append(region)
                self._free.sort(key=lambda r: -r.nbytes)
                while len(self._free) > 2:  # keep the two largest: concurrent callers reuse them
                    self.client.unregister(self._free.pop().handle)

    def layout(
        self, tensors: dict[str, torch.Tensor], return_lse: bool
    ) -> tuple[int, list[tuple[str, torch.Tensor, int]]]:
        """Bytes of scratch a request needs, and the tensors that must be copied there, with
        their offsets (tensors in `empty()` regions are named where they lie)."""
        copies, offset = [], 0
        for name, t in tensors.items():
            if self.where(t) is None:
                copies.append((name, t, offset))
                offset += _aligned(t.numel() * t.element_size())
        q, v = tensors["q"], tensors["v"]
        offset += _aligned(q.shape[0] * q.shape[1] * v.shape[2] * v.element_size())
        if return_lse:
            offset += _aligned(q.shape[1] * q.shape[0] * 4)
        return offset, copies

    def place(
        self, region: ClientRegion, tensors: dict[str, torch.Tensor], return_lse: bool
    ) -> Layout:
        """Copy what `layout` said into `region` and name every tensor's place."""
        _, copies = self.layout(tensors, return_lse)
        places: dict[str, TensorPlace] = {}
        end = 0
        for name, t, offset in copies:
            region.tensor(offset, t.shape, t.dtype).copy_(t)  # the one copy (device -> host)
            places[name] = region.place(offset, t)
            end = offset + _aligned(t.numel() * t.element_size())
        for name, t in tensors.items():
            if name not in places:
                found = self.where(t)
                assert found is not None
                places[name] = found
        q, v = tensors["q"], tensors["v"]
        out = region.tensor(end, (q.shape[0], q.shape[1], v.shape[2]), v.dtype)
        places["out"] = region.place(end, out)
        end += _aligned(out.numel() * out.element_size())
        lse = None
        if return_lse:
            lse = region.tensor(end, (q.shape[1], q.shape[0]), torch.float32)
            places["lse"] = region.place(end, lse)
        return Layout(places, out, lse)

    def close(self) -> None:
        self.client.close()
