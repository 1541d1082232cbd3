"""The Open Inference Protocol's system shared memory: POSIX shared-memory objects a caller
names by key (`/dev/shm/<key>`), registered as regions the infer requests read and write.

Unlike the same-host regions (memfds sealed against shrinking, handed over a socket), such an
object is named, not handed over, and its owner may shrink it at any time. So:

- it is off unless `system_shm` is set, and the token guards it like `/prefill`;
- a key names one object directly in /dev/shm (no path, no link, not a named semaphore), a
  regular file owned by this service's user, at least `offset + byte_size` long when
  registered;
- a region is the caller's that registered it, where tenants have tokens of their own: no
  other tenant sees its name (another's name is unknown, as one never registered), uses it,
  unregisters it, or registers its object; each tenant has its own count and bytes. Without
  tenants all callers are one, as the objects are all this service's user's;
- this process never touches a region's memory: `cu_seq_lens` are read with `pread`, outputs
  the workers did not write in place go out with `pwrite`, and the size is checked again before
  each request. Only workers map and touch it; one killed by SIGBUS (the object shrank in the
  window after the check) is replaced, and its request answered 422 naming the tensor while
  the object is still short.

`SystemShmRegistry`, and every `CallerShm` view of it, is owned by the event loop's thread: it
takes no lock.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..caller import Caller
from ..errors import ForbiddenError, InvalidInputError, NotFoundError
from ..pool import SharedBuffer

__all__ = ["EVERYONE", "SHM_DIR", "CallerShm", "SystemRegion", "SystemShmRegistry", "off_error"]

SHM_DIR = "/dev/shm"
_KEY = re.compile(r"/?([A-Za-z0-9_.\-]{1,200})")


@dataclass(eq=False)
class SystemRegion:
    """A registered region: `byte_size` bytes from `offset` of the object `key`, mapped
    (untouched) as `buffer` for the workers."""

    name: str
    key: str
    offset: int
    byte_size: int
    buffer: SharedBuffer
    inode: tuple[int, int]  # (st_dev, st_ino): two names of one object are one memory

    @property
    def end(self) -> int:
        return self.offset + self.byte_size

    def status(self) -> dict[str, object]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }

    def check_size(self, what: str) -> None:
        """The object still holds the registered range (it may have been shrunk since)."""
        size = os.fstat(self.buffer.fd).st_size
        if size < self.end:
            raise InvalidInputError(
                what,
                f"region {self.name!r} ({self.key}) of at least {self.end} bytes, as registered",
                f"an object shrunk to {size} bytes; register it again",
            )

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view for the workers at `offset` into the region; never read here."""
        return self.buffer.tensor(self.offset + offset, shape, dtype)

    def read(self, what: str, offset: int, nbytes: int) -> bytes:
        """`nbytes` at `offset` into the region, by pread: a shrunk object reads short, here
        an error, where a read of its mapping would be SIGBUS."""
        data = os.pread(self.buffer.fd, nbytes, self.offset + offset)
        if len(data) != nbytes:
            self.check_size(what)
            raise InvalidInputError(what, f"{nbytes} bytes in region {self.name!r}", "fewer")
        return data

    def write(self, offset: int, data: memoryview) -> None:
        """`data` to `offset` into the region, by pwrite (a shrunk object grows back)."""
        at, view = self.offset + offset, data.cast("B")
        while view:
            n = os.pwrite(self.buffer.fd, view, at)
            at, view = at + n, view[n:]


#: the one owner of every region where callers are not told apart (no tenants of their own)
EVERYONE = Caller("everyone")


class SystemShmRegistry:
    """Regions by caller and name. Where `by_caller` (tenants have tokens of their own), a
    region is the caller's that registered it: only that caller sees, names, uses and
    unregisters it, an object it registered is refused to the others, and each caller counts
    its own `max_regions` and `max_bytes`. Else all callers are one (`EVERYONE`)."""

    def __init__(
        self,
        *,
        max_regions: int,
        max_bytes: int,
        adopt: Callable[[int, int], SharedBuffer],
        by_caller: bool,
    ) -> None:
        self.max_regions, self.max_bytes = max_regions, max_bytes
        self.by_caller = by_caller
        self._adopt = adopt
        self._regions: dict[Caller | None, dict[str, SystemRegion]] = {}  # by owner, then by name

    def __len__(self) -> int:
        return sum(len(held) for held in self._regions.values())

    def of(self, caller: Caller | None) -> CallerShm:
        """The regions `caller` (a door's, once authorized) sees and names."""
        return CallerShm(self, caller if self.by_caller else EVERYONE)

    def owner_of(self, inode: tuple[int, int]) -> Caller | None:
        """The caller that registered the object `inode` (None: none has)."""
        for owner, held in self._regions.items():
            if any(r.inode == inode for r in held.values()):
                return owner
        return None


class CallerShm:
    """One caller's regions (`SystemShmRegistry.of`). Another caller's region name is unknown
    here exactly as a name never registered, so a name says nothing of other callers."""

    def __init__(self, registry: SystemShmRegistry, owner: Caller | None) -> None:
        self._registry = registry
        self._owner = owner

    def _held(self) -> dict[str, SystemRegion]:
        return self._registry._regions.get(self._owner, {})

    def __len__(self) -> int:
        return len(self._held())

    def register(self, name: str, key: object, offset: object, byte_size: object) -> None:
        """`byte_size` bytes from `offset` of the object `key` as this caller's region `name`
        (InvalidInputError naming the field at fault; ForbiddenError where another caller
        registered that object)."""
        registry, held = self._registry, self._held()
        if name in held:
            raise InvalidInputError(
                "name",
                "a region name not registered yet",
                f"{name!r}, registered already",
                "Unregister it first",
            )
        if len(held) >= registry.max_regions:
            raise InvalidInputError(
                "name",
                f"at most {registry.max_regions} regions registered",
                "one more",
                "Unregister regions you no longer use",
            )
        match = _KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None or match.group(1) in (".", "..") or match.group(1).startswith("sem."):
            raise InvalidInputError(
                "key",
                "a POSIX shared memory name such as '/my_region' (letters, digits, '_', '.', "
                "'-'; no other '/'; not a named semaphore's 'sem.')",
                repr(key)[:80],
            )
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(field, "a whole number >= 0", repr(value)[:40])
        assert isinstance(offset, int) and isinstance(byte_size, int)
        if byte_size == 0:
            raise InvalidInputError("byte_size", "at least 1", "0")
        mapped = sum(r.offset + r.byte_size for r in held.values())
        if mapped + offset + byte_size > registry.max_bytes:
            raise InvalidInputError(
                "byte_size",
                f"offset + byte_size within the {registry.max_bytes} bytes regions may map in "
                f"all ({mapped} mapped)",
                f"{offset} + {byte_size}",
                "Register only the part of an object that tensors use",
            )
        buffer, inode = self._open(os.path.join(SHM_DIR, match.group(1)), offset, byte_size)
        region = SystemRegion(name, str(key), offset, byte_size, buffer, inode)
        registry._regions.setdefault(self._owner, {})[name] = region

    def _open(self, path: str, offset: int, byte_size: int) -> tuple[SharedBuffer, tuple[int, int]]:
        """The object at `path` opened, checked (a regular file of this service's user, no
        other caller's, holding the range) and mapped to the range's end; and its inode."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise InvalidInputError(
                "key",
                f"a shared memory object this service can open ({path})",
                exc.strerror or str(exc),
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_dev != os.stat(SHM_DIR).st_dev:
                raise InvalidInputError("key", f"a regular file in {SHM_DIR}", f"not one: {path}")
            if st.st_uid != os.geteuid():
                raise InvalidInputError(
                    "key",
                    f"an object owned by this service's user (uid {os.geteuid()})",
                    f"uid {st.st_uid}",
                )
            inode = (st.st_dev, st.st_ino)
            owner = self._registry.owner_of(inode)
            if owner is not None and owner != self._owner:
                raise ForbiddenError(
                    f"key: {path} is registered by another tenant, and an object is its "
                    "registrant's until it unregisters it; register an object of your own"
                )
            if st.st_size < offset + byte_size:
                raise InvalidInputError(
                    "byte_size",
                    f"offset + byte_size within {path} ({st.st_size} bytes)",
                    f"{offset} + {byte_size}",
                )
            try:
                owned, fd = fd, -1  # the buffer's now, closed by it even when it fails
                buffer = self._registry._adopt(owned, offset + byte_size)
            except (OSError, OverflowError, ValueError) as exc:  # no address space for it
                raise InvalidInputError(
                    "byte_size",
                    "offset + byte_size this service can map",
                    f"{offset} + {byte_size}: {getattr(exc, 'strerror', None) or exc}",
                ) from None
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return buffer, inode

    def unregister(self, name: str | None) -> None:
        """One of this caller's regions (an unknown name is no error, as in Triton), or all of
        them with None. A request in flight keeps its region's mapping until it is done."""
        held = self._registry._regions.get(self._owner)
        if held is None:
            return
        if name is None:
            held.clear()
        else:
            held.pop(name, None)
        if not held:
            del self._registry._regions[self._owner]

    def status(self, name: str | None) -> list[dict[str, object]]:
        """This caller's regions (or the one named): name, key, offset, byte_size."""
        if name is None:
            return [r.status() for r in self._held().values()]
        return [self.get(name).status()]

    def get(self, name: str) -> SystemRegion:
        """This caller's region `name` (NotFoundError where it has none of that name)."""
        region = self._held().get(name)
        if region is None:
            raise NotFoundError(f"no system shared memory region named {name[:80]!r}")
        return region

    def resolve(self, what: str, name: object) -> SystemRegion:
        """This caller's region a tensor names, or InvalidInputError naming the tensor."""
        region = self._held().get(name) if isinstance(name, str) else None
        if region is None:
            raise InvalidInputError(what, "a registered region name", repr(name)[:80])
        return region

    def place(
        self, what: str, name: object, offset: int, nbytes: int, dtype: torch.dtype
    ) -> SystemRegion:
        """This caller's region `name` for the tensor `what` of `nbytes` at `offset` into it,
        the range checked against the registration and the object's size now."""
        region = self.resolve(f"{what}.shared_memory_region", name)
        end = offset + nbytes
        if end > region.byte_size:
            raise InvalidInputError(
                what,
                f"bytes [{offset}, {end}) inside region {region.name!r} of {region.byte_size} "
                "bytes",
                f"a range past its end by {end - region.byte_size} bytes",
            )
        if (region.offset + offset) % dtype.itemsize:
            raise InvalidInputError(
                f"{what}.shared_memory_offset",
                f"a multiple of {dtype.itemsize} bytes from the object's start",
                str(offset),
            )
        region.check_size(what)
        return region


def off_error() -> ForbiddenError:
    return ForbiddenError(
        "system shared memory is off on this server: it lets a caller name /dev/shm objects "
        "for the service to read and write; start it with ZEN_MLA_SYSTEM_SHM=true to offer it"
    )
