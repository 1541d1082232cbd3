"""`Caller`: whom a request is counted against: the service's shares (slots, places, bytes),
the pool's turns between queued work, and the owner of a system shared memory region.

    Caller.tenant("team-a")       the tenant a bearer token names
    Caller.of("10.0.0.1")         a TCP peer (the address a trusted proxy forwarded)
    Caller.of(1000)               a region socket peer, by its uid
    Caller.of(None)               a peer with no address (HTTP over a Unix socket)

`str(caller)` is how the log line names it: `tenant:team-a`, `addr:10.0.0.1`, `uid:1000`,
`local`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Caller"]


@dataclass(frozen=True, slots=True)
class Caller:
    """kind: "tenant", "addr", "uid" or "local" (or a name of the library's own, such as
    system shared memory's "everyone"); name: the tenant, the address or the uid ("" where the
    kind says all)."""

    kind: str
    name: str = ""

    @classmethod
    def tenant(cls, name: str) -> Caller:
        return cls("tenant", name)

    @classmethod
    def of(cls, peer: object) -> Caller:
        """The caller a connection's peer is where no token names a tenant: a uid (an int) for
        a region socket peer, an address (a str) for a TCP peer, `local` for none."""
        if isinstance(peer, int) and not isinstance(peer, bool):
            return cls("uid", str(peer))
        if isinstance(peer, str) and peer:
            return cls("addr", peer)
        return cls("local")

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}" if self.name else self.kind
