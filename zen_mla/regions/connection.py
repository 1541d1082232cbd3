"""A client's side of same-host shared memory: its connection to a service's region socket, the
regions it registered there, and each request laid out in them.

Scratch regions hold a request's inputs (one copy, straight from the caller's tensors, also from
CUDA) and its outputs; they are reused across calls and replaced by larger ones when a request
does not fit. `empty()` gives a tensor in a region of its own, which a request then names where
it lies, without a copy; the region is unregistered once the tensor is gone.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import mmap
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..copying import copy_into
from ..errors import (
    BY_STATUS,
    DeadlineExceededError,
    InvalidInputError,
    ProtocolError,
    SharedMemoryUnavailableError,
    ZenMLAError,
)
from ..wire import regions_json
from ..wire.dtypes import BY_TORCH
from ..wire.regions_json import TensorPlace
from .memfd import create_sealed_memfd
from .protocol import (
    CALL_ROOM,
    MAX_MESSAGE,
    FrameError,
    call_fields,
    decode_object,
    numbered,
    recv_frame,
    send_frame,
)

__all__ = ["ClientRegion", "Layout", "RegionConnection", "RegionSet", "prefill_fields"]

ALIGN = 64
MIN_SCRATCH = 16 << 20
SLOTS_KEPT = 64  # views kept per region (ClientRegion.slot)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RegionConnection:
    """One connection to one service's region socket; one request at a time (a lock).

    `timeout` bounds each exchange as a whole (send, wait, read), whatever the other end does;
    a reply is read by the protocol's one reader (`recv_frame`), up to `MAX_MESSAGE` bytes. A
    failed exchange closes the connection (its regions end with it): timed out,
    DeadlineExceededError; a reply that is not a frame of a JSON object, ProtocolError; the
    socket gone, SharedMemoryUnavailableError.
    """

    def __init__(self, path: str, token: str | None, timeout: float = 10.0) -> None:
        self._lock = threading.Lock()
        self._timeout = timeout
        self._calls = 0  # prefill calls numbered on this connection
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
            self.hello = self._call({"op": "hello", "token": token or ""})
        except (OSError, ZenMLAError) as exc:
            self._sock.close()
            raise SharedMemoryUnavailableError(f"region socket {path}: {exc}") from exc

    @property
    def closed(self) -> bool:
        """The connection ended (a failed exchange closes it): its regions are gone."""
        return self._sock.fileno() == -1

    @property
    def calls(self) -> bool:
        """The service takes prefill calls on this socket (`prefill` frames)."""
        return self.hello.get("calls") is True

    def _call(self, message: dict[str, Any], fd: int | None = None) -> dict[str, Any]:
        with self._lock:
            reply = self._exchange(message, fd, self._timeout)
        if reply.get("ok") is not True:
            raise _refusal(reply)
        return reply

    def try_call(self, fields: bytes, timeout: float | None) -> dict[str, Any] | None:
        """One prefill call's exchange (`fields`: `prefill_fields`'s, numbered here), its
        reply as it came (the caller reads it), waiting at most `timeout` seconds (None: as
        long as it takes); None, without a byte sent, while another exchange holds the
        connection (the service answers one call per connection at a time) or when the frame
        would pass the service's cap: the caller goes another way."""
        if len(fields) + CALL_ROOM > MAX_MESSAGE or not self._lock.acquire(blocking=False):
            return None
        try:
            self._calls += 1
            frame = numbered(self._calls, fields, timeout)
            return self._exchange(frame, None, timeout, self._calls)
        finally:
            self._lock.release()

    def _exchange(
        self,
        message: dict[str, Any] | bytes,
        fd: int | None,
        timeout: float | None,
        call: int | None = None,
    ) -> dict[str, Any]:
        """Send, then read the reply by `timeout`; the lock held. A failure closes the
        connection: a reply may still be on its way, and would be taken for the next one's.
        A reply numbered for another `call` than this one is passed over (an earlier call's:
        its worker wrote one as the service answered it past its deadline)."""
        try:
            if timeout is not None and timeout <= 0:
                raise TimeoutError
            deadline = None if timeout is None else time.monotonic() + timeout
            self._sock.settimeout(timeout)
            send_frame(self._sock, message, fd)
            while True:
                reply = recv_frame(self._sock, deadline, decode_object)
                if call is None or reply.get("call", call) == call:
                    return reply
        except TimeoutError as exc:
            self._sock.close()
            raise DeadlineExceededError(
                f"the region socket did not answer within {timeout} s"
            ) from exc
        except OSError as exc:
            self._sock.close()
            raise SharedMemoryUnavailableError(f"the region socket failed: {exc}") from exc
        except FrameError as exc:
            self._sock.close()
            raise ProtocolError(f"the region socket's reply: {exc}"[:300]) from exc

    def register(self, fd: int) -> str:
        handle = self._call({"op": "register"}, fd).get("region")
        if not isinstance(handle, str) or not handle:
            raise ProtocolError(f"the region socket registered a region as {handle!r:.40}")
        return handle

    def unregister(self, handle: str) -> None:
        with contextlib.suppress(OSError, ZenMLAError):
            self._call({"op": "unregister", "region": handle})

    def weight(self, name: str, place: TensorPlace) -> dict[str, Any]:
        """Register the weight `name` (a layer's `w_kv_b`) from where it lies in one of this
        connection's regions (the service keeps a copy): its entry, as `GET /weights` lists
        it. The ZenMLAError the service answered, where it refused."""
        body = regions_json.encode({"w_kv_b": place}).decode()
        reply = self._call({"op": "weight", "name": name, "body": body})
        try:
            entry = json.loads(str(reply.get("body")))
        except ValueError as exc:
            raise ProtocolError(f"the region socket's weight entry: {exc}"[:300]) from exc
        if not isinstance(entry, dict):
            raise ProtocolError("the region socket's weight entry is no JSON object")
        return entry

    def forget(self, name: str) -> None:
        """Forget the weight `name` this client registered (on any of its connections)."""
        self._call({"op": "forget", "name": name})

    def close(self) -> None:
        self._sock.close()  # the service drops every region of this connection


def prefill_fields(places: Mapping[str, TensorPlace], options: Mapping[str, str]) -> bytes:
    """The fields of the `prefill` frame of a request naming `places`, with `options` (the
    regions JSON; `RegionConnection.try_call` numbers it). An orchestrator sends the same ones
    layer after layer: the last `FRAMES_KEPT` made are kept (~10 us of JSON, ~1 us kept)."""
    return _prefill_fields(tuple(places.items()), tuple(options.items()))


FRAMES_KEPT = 64


@functools.lru_cache(maxsize=FRAMES_KEPT)
def _prefill_fields(
    places: tuple[tuple[str, TensorPlace], ...], options: tuple[tuple[str, str], ...]
) -> bytes:
    return call_fields({"body": regions_json.encode(dict(places), dict(options)).decode()})


def _refusal(reply: dict[str, Any]) -> ZenMLAError:
    """The error a `{"ok": false, "status", "error"}` reply stands for; a reply without a
    known status is a ZenMLAError all the same."""
    status = reply.get("status")
    cls = BY_STATUS.get(status, ZenMLAError) if type(status) is int else ZenMLAError
    error = str(reply.get("error"))[:500]
    if issubclass(cls, InvalidInputError):
        return cls("region socket request", "one the service accepts", error)
    return cls(error)


class ClientRegion:
    """A registered memfd, mapped here; its pages are allocated before it is registered (the
    service refuses a region with holes: its memory is the client's to pay for)."""

    def __init__(self, connection: RegionConnection, nbytes: int) -> None:
        fd = create_sealed_memfd(nbytes)
        try:
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            self.handle = connection.register(fd)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.base = self.bytes.data_ptr()
        # (offset, shape, dtype) -> a view and its place: a scratch region is laid out the
        # same way call after call (an orchestrator's layers), and making them is ~5 us each
        self._slots: dict[tuple[int, tuple[int, ...], torch.dtype], _Slot] = {}
        _pin(self)

    def tensor(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = dtype.itemsize
        for d in shape:
            n *= d
        return self.bytes[offset : offset + n].view(dtype).view(*shape)

    def slot(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> _Slot:
        """A view of this region and its place, for the client's own use (never handed to a
        caller: the same view object comes back for the same slot)."""
        key = (offset, shape, dtype)
        found = self._slots.get(key)
        if found is None:
            if len(self._slots) >= SLOTS_KEPT:
                self._slots.clear()
            view = self.tensor(offset, shape, dtype)
            found = self._slots[key] = _Slot(view, self.place(offset, view))
        return found

    def place(self, offset: int, t: torch.Tensor) -> TensorPlace:
        return TensorPlace(self.handle, offset, BY_TORCH[t.dtype].safetensors, tuple(t.shape))

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where `t` lies in this region, if it is a contiguous CPU tensor inside it."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        start = t.data_ptr()
        if self.base <= start and start + t.numel() * t.element_size() <= self.base + self.nbytes:
            return start - self.base
        return None


@dataclass(frozen=True, slots=True)
class _Slot:
    view: torch.Tensor
    place: TensorPlace


def _overlap(a: TensorPlace, b: TensorPlace) -> bool:
    return (
        a.region == b.region and a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes
    )


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

    def __init__(self, connection: RegionConnection) -> None:
        self.connection = connection
        self._lock = threading.Lock()  # guards the lists below
        self._free: list[ClientRegion] = []
        self._own: list[ClientRegion] = []  # behind empty() tensors
        self._gone: list[str] = []  # handles of empty() regions whose tensor was collected

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in a region of its own: a request that names it sends no copy of it."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        region = ClientRegion(self.connection, max(_aligned(n), ALIGN))
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
            self.connection.unregister(handle)

    def where(self, t: torch.Tensor) -> TensorPlace | None:
        return self._where_all({"t": t})["t"]

    def _where_all(self, tensors: dict[str, torch.Tensor]) -> dict[str, TensorPlace | None]:
        """Where each tensor lies in an `empty()` region, None for those that do not."""
        with self._lock:
            regions = list(self._own)
        found: dict[str, TensorPlace | None] = dict.fromkeys(tensors)
        for region in regions:
            for name, t in tensors.items():
                if found[name] is None and (offset := region.offset_of(t)) is not None:
                    found[name] = region.place(offset, t)
        return found

    def weight(self, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        """Register `tensor` (a layer's `w_kv_b`) as the weight `name`: copied into a scratch
        region and named there (`RegionConnection.weight`; the service keeps its own copy)."""
        with self.scratch(tensor.nbytes) as region:
            slot = region.slot(0, tuple(tensor.shape), tensor.dtype)
            copy_into(slot.view, tensor)
            return self.connection.weight(name, slot.place)

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
            region = ClientRegion(self.connection, max(MIN_SCRATCH, _aligned(nbytes) * 5 // 4))
        try:
            yield region
        finally:
            with self._lock:
                self._free.append(region)
                self._free.sort(key=lambda r: -r.nbytes)
                while len(self._free) > 2:  # keep the two largest: concurrent callers reuse them
                    self.connection.unregister(self._free.pop().handle)

    @contextlib.contextmanager
    def request(
        self,
        tensors: dict[str, torch.Tensor],
        return_lse: bool,
        out: torch.Tensor | None = None,
        *,
        out_like: tuple[tuple[int, ...], torch.dtype] | None = None,
    ) -> Iterator[Layout]:
        """Lay a request out in a scratch region (tensors in `empty()` regions are named where
        they lie, the others copied once) and yield where everything is; the region is this
        caller's until the block ends. An `out` of the caller's that lies in an `empty()`
        region, apart from the inputs, is named as the place to write (no copy back; not with
        an LSE, which the service writes in out's region). `out_like`: the answer's shape and
        dtype, where the request has no `v` to take them from (over MLA's latent cache)."""
        found = self._where_all(tensors if out is None or return_lse else {**tensors, "out": out})
        own_out = found.pop("out", None)
        if own_out is not None and any(_overlap(own_out, p) for p in found.values() if p):
            own_out = None  # the service writes no output over an input
        moved = {n: t for n, t in tensors.items() if found[n] is None}
        sizes = {n: _aligned(t.numel() * t.element_size()) for n, t in moved.items()}
        q = tensors["q"]
        if out_like is None:
            v = tensors["v"]
            out_like = ((q.shape[0], q.shape[1], v.shape[2]), v.dtype)
        out_shape, out_dtype = out_like
        out_bytes = (
            0 if own_out is not None else _aligned(math.prod(out_shape) * out_dtype.itemsize)
        )
        lse_bytes = _aligned(q.shape[0] * q.shape[1] * 4) if return_lse else 0
        with self.scratch(sum(sizes.values()) + out_bytes + lse_bytes) as region:
            places = {n: p for n, p in found.items() if p is not None}
            offset = 0
            for name, t in moved.items():
                slot = region.slot(offset, tuple(t.shape), t.dtype)
                copy_into(slot.view, t)  # the one copy (CUDA too)
                places[name] = slot.place
                offset += sizes[name]
            if own_out is not None and out is not None:
                places["out"], out_view = own_out, out
            else:
                slot = region.slot(offset, out_shape, out_dtype)
                places["out"], out_view = slot.place, slot.view
            lse = None
            if return_lse:
                lse = region.slot(offset + out_bytes, (q.shape[1], q.shape[0]), torch.float32)
                places["lse"] = lse.place
            yield Layout(places, out_view, lse.view if lse is not None else None)

    def close(self) -> None:
        self.connection.close()
