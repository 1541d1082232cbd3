"""Same-host regions: shared memory a client on the service's host hands over a Unix socket (or,
for the Open Inference Protocol, names in /dev/shm), so that no tensor byte crosses a socket.
Both ends live here:

    memfd.py       sealed, populated anonymous memory (made by the client, checked by the service)
    protocol.py    the socket's frames, and the one reader of them
    registry.py    the service's regions by handle, their limits and their checks
    server.py      the service's end of the socket
    connection.py  the client's end: its connection, registration, regions, places of tensors
    system_shm.py  the service's registry of /dev/shm objects named by key (system shared memory)

The service's names are below; they load on first use, so a client importing `regions.connection`
does not load the server's end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
    from .protocol import encode_frame
    from .registry import RegionRegistry, Span, check_disjoint
    from .server import Calls, Ended, RegionServer
    from .system_shm import SHM_DIR, CallerShm, SystemRegion, SystemShmRegistry, off_error

__all__ = [
    "SHM_DIR",
    "CallerShm",
    "Calls",
    "Ended",
    "RegionRegistry",
    "RegionServer",
    "Span",
    "SystemRegion",
    "SystemShmRegistry",
    "check_disjoint",
    "encode_frame",
    "off_error",
]

_LAZY = {
    "SHM_DIR": ".system_shm",
    "Calls": ".server",
    "CallerShm": ".system_shm",
    "Ended": ".server",
    "RegionRegistry": ".registry",
    "RegionServer": ".server",
    "Span": ".registry",
    "SystemRegion": ".system_shm",
    "SystemShmRegistry": ".system_shm",
    "check_disjoint": ".registry",
    "encode_frame": ".protocol",
    "off_error": ".system_shm",
}

__getattr__ = lazy_names(__name__, _LAZY)
