"""Same-host regions: shared memory a client hands the service, by handle.

A client creates a memfd sealed against shrinking and passes its descriptor over a Unix socket
(SCM_RIGHTS, `region_server`); it gets an unguessable handle back, which its prefill requests
name instead of sending tensor bytes (`region_request`). The service maps only memory handed to
it this way. A region ends when its client unregisters it or closes the socket; a request in
flight keeps its mapping alive until it finishes.

`RegionRegistry` is owned by the event loop's thread (the region server and the HTTP handlers
run there): it takes no lock.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError, ServiceUnavailableError
from ..pool import SharedBuffer
from ..wire.dtypes import BY_SAFETENSORS
from ..wire.regions_json import TensorPlace
from .memfd import check_sealed_memfd

__all__ = ["Region", "RegionRegistry", "Span", "check_disjoint"]


@dataclass(eq=False)
class Region:
    """A client's memfd, mapped here: `buffer` is what the workers are handed."""

    handle: str
    nbytes: int
    memory: tuple[int, int]  # (st_dev, st_ino): two handles of one memfd are one memory
    buffer: SharedBuffer


class RegionRegistry:
    """Regions by handle, with per-client limits on their number and bytes. A client's regions
    are the dict it holds (`held`), so dropping a client drops exactly its own.

    `memo` is for what a caller derives from the regions as they are (a request's tensors,
    resolved): it is emptied whenever a region goes, so nothing kept there outlives a region
    or keeps its memory mapped."""

    def __init__(
        self,
        *,
        max_regions: int,
        max_bytes: int,
        adopt: Callable[[int, int], SharedBuffer],
    ) -> None:
        self.max_regions, self.max_bytes = max_regions, max_bytes
        self._adopt = adopt
        self._regions: dict[str, Region] = {}
        self.memo: dict[object, object] = {}

    def __len__(self) -> int:
        return len(self._regions)

    def register(self, fd: int, held: dict[str, Region]) -> Region:
        """Take `fd` (closed here whatever happens; the mapping keeps the memory) as a new
        region of the client whose regions are `held`."""
        try:
            nbytes = check_sealed_memfd(fd)
            st = os.fstat(fd)
            memory = (st.st_dev, st.st_ino)
            if len(held) >= self.max_regions:
                raise InvalidInputError(
                    "region", f"at most {self.max_regions} regions per client", f"{len(held) + 1}"
                )
            total = sum(r.nbytes for r in held.values()) + nbytes
            if total > self.max_bytes:
                raise InvalidInputError(
                    "region",
                    f"at most {self.max_bytes} bytes of regions per client",
                    f"{total} bytes",
                    "Unregister regions you no longer use",
                )
            if any(r.memory == memory for r in held.values()):
                raise InvalidInputError(
                    "region", "each memfd registered once", "a memfd that is registered already"
                )
            buffer = self._map(fd, nbytes)
        finally:
            os.close(fd)
        region = Region(secrets.token_urlsafe(18), nbytes, memory, buffer)
        self._regions[region.handle] = region
        held[region.handle] = region
        return region

    def _map(self, fd: int, nbytes: int) -> SharedBuffer:
        try:
            own = os.dup(fd)
        except OSError as exc:  # out of descriptors here: the client may try again later
            raise ServiceUnavailableError(f"region: cannot take a descriptor now ({exc})") from exc
        try:
            return self._adopt(own, nbytes)  # closes `own` when it fails
        except OSError as exc:
            hint = " (a hugetlb memfd needs free huge pages)" if exc.errno == errno.ENOMEM else ""
            raise InvalidInputError(
                "region", "a memfd this service can map shared, read-write", f"{exc}{hint}"
            ) from exc

    def unregister(self, handle: str, held: dict[str, Region]) -> None:
        if held.pop(handle, None) is None:
            raise InvalidInputError("region", "a handle this client registered", _shown(handle))
        del self._regions[handle]
        self.memo.clear()

    def drop(self, held: dict[str, Region]) -> None:
        for handle in held:
            self._regions.pop(handle, None)
        if held:
            self.memo.clear()
        held.clear()

    def resolve(self, handle: str) -> Region:
        region = self._regions.get(handle)
        if region is None:
            raise InvalidInputError("region", "a registered region handle", _shown(handle))
        return region

    def tensor(self, name: str, place: TensorPlace, dtypes: tuple[str, ...]) -> torch.Tensor:
        """The tensor `place` names, checked against its region, as a view of its mapping;
        `dtypes` are the safetensors dtype names allowed for it."""
        if place.dtype not in dtypes:
            raise InvalidInputError(f"{name}.dtype", f"one of {', '.join(dtypes)}", place.dtype)
        region = self.resolve(place.region)
        dtype = BY_SAFETENSORS[place.dtype].torch
        if place.offset % dtype.itemsize:
            raise InvalidInputError(
                f"{name}.offset",
                f"a multiple of {dtype.itemsize} bytes ({place.dtype})",
                str(place.offset),
            )
        end = place.offset + place.nbytes
        if end > region.nbytes:
            raise InvalidInputError(
                name,
                f"bytes [{place.offset}, {end}) inside its region of {region.nbytes} bytes",
                f"a range past its end by {end - region.nbytes} bytes",
            )
        return region.buffer.tensor(place.offset, place.shape, dtype)

    def check_disjoint(self, places: Mapping[str, TensorPlace], outputs: tuple[str, ...]) -> None:
        """The tensors named `outputs` overlap neither each other nor any other tensor in
        `places` (`check_disjoint` below; one memfd behind two handles is one memory).
        `places` holds at most the request's few tensor names."""
        spans = [
            Span(n, self.resolve(p.region).memory, p.offset, p.offset + p.nbytes, p.region)
            for n, p in places.items()
        ]
        check_disjoint(spans, outputs, "same memfd")


@dataclass(frozen=True, slots=True)
class Span:
    """Bytes `[start, end)` of one memory, taken by the tensor `name`, which the request reached
    through the region it calls `region` (a handle, a registered name)."""

    name: str
    memory: tuple[int, int]  # (st_dev, st_ino): two names of one memory are one memory
    start: int
    end: int
    region: str


def check_disjoint(spans: Sequence[Span], outputs: Sequence[str], alias: str) -> None:
    """The one overlap check of every kind of region: the spans of `outputs` (in that order)
    overlap no other span, so that a worker writing them cannot change what another reads.
    Spans are compared by the memory they are, so one memory behind two region names is one;
    an empty span overlaps nothing. InvalidInputError names the output, the other tensor and
    both ranges, with `alias` ("same memfd") where the two came through different regions."""
    for name in outputs:
        for span in spans:
            if span.name != name or span.start == span.end:
                continue
            for other in spans:
                if (
                    other is not span
                    and other.memory == span.memory
                    and other.start < other.end
                    and span.start < other.end
                    and other.start < span.end
                ):
                    same = "" if other.region == span.region else f", {alias}"
                    raise InvalidInputError(
                        name,
                        f"bytes overlapping no other tensor "
                        f"({other.name}: [{other.start}, {other.end}){same})",
                        f"[{span.start}, {span.end})",
                    )


def _shown(handle: str) -> str:
    return repr(handle[:32])
