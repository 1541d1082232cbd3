"""Same-host regions: shared memory a client hands the service, by handle.

A client creates a memfd sealed against shrinking, its pages populated, and passes its
descriptor over a Unix socket (SCM_RIGHTS, `region_server`); it gets an unguessable handle back,
which its prefill requests name instead of sending tensor bytes (`region_request`). The service
maps only memory handed to it this way. A region ends when its client unregisters it or closes
the socket; a request in flight keeps its mapping alive until it finishes, and then this process
unmaps it at once and the workers are told to (`SharedBuffer.release`).

Regions cost their owner. A memfd whose pages are not all populated is refused at registration,
as is one holding pages past its end (they would stand for holes inside it); it is sealed against
growing as it is taken, so none can come to lie there later. A region found with holes when a
request names it refuses the request: pages a worker faulted into a hole would be the service's
memory, charged to it. What a client that punches holes between that check and a worker's read
makes the service fault in is bounded by what its regions are charged: every page a worker can
map (`charged_bytes`), against a budget per owner (the peer's uid on the region socket, over all
its connections), and `max_total_bytes` caps the regions of all owners together. A region sealed
against writing since it was registered refuses the requests that name it the same way (a worker
could not map it to write the outputs).

`RegionRegistry` is owned by the event loop's thread (the region server and the HTTP handlers
run there): it takes no lock.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError, ServiceUnavailableError
from ..pool import SharedBuffer
from ..wire.dtypes import BY_SAFETENSORS
from ..wire.regions_json import TensorPlace
from .memfd import (
    charged_bytes,
    check_populated,
    check_sealed_memfd,
    seal_against_growth,
    unpopulated,
    writable,
)

__all__ = ["Region", "RegionRegistry", "Span", "check_disjoint"]


@dataclass(eq=False)
class Region:
    """A client's memfd, mapped here: `buffer` is what the workers are handed."""

    handle: str
    nbytes: int
    charged: int  # what its owner's budget counts: every page a worker may fault in
    memory: tuple[int, int]  # (st_dev, st_ino): two handles of one memfd are one memory
    buffer: SharedBuffer
    owner: Hashable  # whose byte budget it counts against: the peer's uid on the region socket


class RegionRegistry:
    """Regions by handle, with per-client limits on their number (per connection: the dict a
    client holds, `held`, so dropping a client drops exactly its own) and on their bytes (per
    `owner`, over all its connections: `max_bytes`; and over all owners: `max_total_bytes`,
    by default the host's memory).

    `memo` is for what a caller derives from the regions as they are (a request's tensors,
    resolved): it is emptied whenever a region goes, so nothing kept there outlives a region
    or keeps its memory mapped. A caller that reuses what it kept checks that the regions are
    still usable first (`check_usable`)."""

    def __init__(
        self,
        *,
        max_regions: int,
        max_bytes: int,
        adopt: Callable[[int, int], SharedBuffer],
        max_total_bytes: int | None = None,
    ) -> None:
        self.max_regions, self.max_bytes = max_regions, max_bytes
        self.max_total_bytes = _host_memory() if max_total_bytes is None else max_total_bytes
        self._adopt = adopt
        self._regions: dict[str, Region] = {}
        self._bytes: dict[Hashable, int] = {}  # owner -> bytes of its regions
        self._total = 0  # bytes of all regions
        self.memo: dict[object, object] = {}

    def __len__(self) -> int:
        return len(self._regions)

    def bytes_of(self, owner: Hashable) -> int:
        """Bytes charged for the regions `owner` holds, over all its connections."""
        return self._bytes.get(owner, 0)

    @property
    def total_bytes(self) -> int:
        """Bytes charged for the regions of all owners."""
        return self._total

    def register(self, fd: int, held: dict[str, Region], owner: Hashable = None) -> Region:
        """Take `fd` (closed here whatever happens; the mapping keeps the memory) as a new
        region of the client whose regions are `held`, charged to `owner`'s bytes. A memfd that
        passes the checks of what it is is sealed against growing, refused or not."""
        try:
            nbytes = check_sealed_memfd(fd)
            st = os.fstat(fd)
            memory = (st.st_dev, st.st_ino)
            if len(held) >= self.max_regions:
                raise InvalidInputError(
                    "region", f"at most {self.max_regions} regions per client", f"{len(held) + 1}"
                )
            charged = charged_bytes(fd, nbytes)
            mine = self.bytes_of(owner) + charged
            if mine > self.max_bytes:
                raise InvalidInputError(
                    "region",
                    f"at most {self.max_bytes} bytes of regions per client (its user's, over "
                    "all its connections)",
                    f"{mine} bytes",
                    "Unregister regions you no longer use",
                )
            if self._total + charged > self.max_total_bytes:
                raise ServiceUnavailableError(
                    f"region: the service holds {self._total} bytes of regions of all its "
                    f"clients, and takes at most {self.max_total_bytes}; try again later",
                    retry_after=1.0,
                )
            if any(r.memory == memory for r in held.values()):
                raise InvalidInputError(
                    "region", "each memfd registered once", "a memfd that is registered already"
                )
            seal_against_growth(fd)  # first: no page can come past its end once it is checked
            check_populated(fd, nbytes)
            buffer = self._map(fd, nbytes)
        finally:
            os.close(fd)
        region = Region(secrets.token_urlsafe(18), nbytes, charged, memory, buffer, owner)
        self._regions[region.handle] = region
        held[region.handle] = region
        self._bytes[owner] = mine
        self._total += charged
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
        region = held.pop(handle, None)
        if region is None:
            raise InvalidInputError("region", "a handle this client registered", _shown(handle))
        self._end([region])

    def drop(self, held: dict[str, Region]) -> None:
        """End every region of a client that left."""
        regions = list(held.values())
        held.clear()
        self._end(regions)

    def _end(self, regions: Iterable[Region]) -> None:
        """Forget `regions` (handles, bytes, what the memo kept of them) and give their memory
        up: at once, or once the requests in flight that name them are done."""
        ended = [r for r in regions if self._regions.pop(r.handle, None) is not None]
        if not ended:
            return
        self.memo.clear()
        for region in ended:
            left = self._bytes[region.owner] - region.charged
            if left:
                self._bytes[region.owner] = left
            else:
                del self._bytes[region.owner]
            self._total -= region.charged
            region.buffer.release()

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
        _check_usable(name, region)
        return region.buffer.tensor(place.offset, place.shape, dtype)

    def check_usable(self, places: Mapping[str, TensorPlace]) -> None:
        """Each region `places` names is registered, still has all its pages (a client may
        punch holes in a region after registering it) and is not sealed against writing (a
        client may add F_SEAL_FUTURE_WRITE); InvalidInputError names the first tensor that
        lies in one that is not. One `fcntl` and one `fstat` per region (~2 us): for a request
        whose resolution was kept (`memo`), which `tensor()` then does not check again."""
        seen: set[str] = set()
        for name, place in places.items():
            if place.region not in seen:
                seen.add(place.region)
                _check_usable(name, self.resolve(place.region))

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


def _check_usable(name: str, region: Region) -> None:
    """What a region must still be each time a request names it: writable by a worker, and
    whole."""
    if not writable(region.buffer.fd):
        raise InvalidInputError(
            f"{name}.region",
            "a region the service may write (a worker maps it to write the outputs)",
            f"region {_shown(region.handle)} sealed against writing since it was registered",
            "Add no write seal to the memfd of a registered region",
        )
    holes = unpopulated(region.buffer.fd, region.nbytes)
    if holes:
        raise InvalidInputError(
            name,
            "a place in a region whose pages are all populated (punch no holes in a region "
            "while it is registered)",
            f"{holes} of its region's {region.nbytes} bytes are holes",
        )


def _host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _shown(handle: str) -> str:
    return repr(handle[:32])
