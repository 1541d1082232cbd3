"""Weights registered once and named on later calls: a layer's `kv_b_proj` weight (`w_kv_b`),
which a request over MLA's latent cache attends with (`zen_mla.attention.latent`).

A weight is its caller's: registered, listed, used and forgotten by the caller (tenant, or peer
without tenants) that sent it; another caller's names answer as never registered. It lies in
one of the engine's shared buffers, the body it came in (the workers read it there in place),
and its bytes stay charged to its caller's share of the service's memory until it is forgotten
(`DELETE /weights/{name}`, or registered again under its name; one registered on the region
socket, also once its connection ends). Weights hold at most half the
service's byte budget, all callers together: requests keep the rest, whoever holds weights.
Work using a weight holds a lease: a weight forgotten meanwhile is let go when the last such
work ends.

Owner: the event loop's thread (routes and forms on it register, lease and forget), so nothing
here needs a lock; a lease is given back from the request's own task.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zen_mla import InvalidInputError, NotFoundError, QueueFullError
from zen_mla.caller import Caller
from zen_mla.engine import PrefillEngine, SharedBuffer

from .admission import Charge

__all__ = ["Weight", "Weights"]


@dataclass(eq=False)
class Weight:
    """One registered weight: its tensor, a view of `buffer`, and the charge for its bytes."""

    name: str
    caller: Caller | None
    tensor: torch.Tensor
    buffer: SharedBuffer
    charge: Charge
    connection: int | None = None  # the region-socket connection it came by: ends with it
    leases: int = 0
    forgotten: bool = False

    def entry(self) -> dict[str, object]:
        """What the caller is told of it: name, shape, dtype, bytes."""
        t = self.tensor
        dtype = str(t.dtype).removeprefix("torch.")
        return {"name": self.name, "shape": list(t.shape), "dtype": dtype, "bytes": t.nbytes}


class Weights:
    """The weights registered, by caller and name. Owner: the event loop's thread."""

    def __init__(self, engine: PrefillEngine, max_weights: int, max_bytes: int) -> None:
        self.engine = engine
        self.max_weights = max_weights
        self.max_bytes = max_bytes
        self.held_bytes = 0  # charged for the weights registered, every caller's
        self._by_caller: dict[Caller | None, dict[str, Weight]] = {}

    def check_room(self, caller: Caller | None, name: str, nbytes: int = 0) -> None:
        """InvalidInputError where registering `name` would take the caller past `max_weights`
        (one of that name is replaced, not added); QueueFullError where `nbytes` more would take
        the weights of every caller past `max_bytes` (half the service's byte budget: the rest
        stays for requests, whoever holds weights)."""
        mine = self._by_caller.get(caller, {})
        if name not in mine and len(mine) >= self.max_weights:
            raise InvalidInputError(
                "name",
                f"at most {self.max_weights} weights registered (--max-weights)",
                "one more",
                "Forget the weights you no longer use (DELETE /weights/{name})",
            )
        if self.held_bytes + nbytes > self.max_bytes:
            raise QueueFullError(
                f"registered weights hold {self.held_bytes} bytes; {nbytes} more would pass "
                f"the {self.max_bytes} they may hold (half of --max-inflight-bytes)",
                retry_after=5,
            )

    def register(self, weight: Weight) -> None:
        """`weight` under its name for its caller, in place of one of that name (let go once
        its work ends); `check_room` first."""
        mine = self._by_caller.setdefault(weight.caller, {})
        old = mine.get(weight.name)
        mine[weight.name] = weight
        self.held_bytes += weight.charge.nbytes
        if old is not None:
            self._forget(old)

    def lease(self, caller: Caller | None, name: str, where: str) -> Weight:
        """The caller's weight `name`, held for one piece of work until `give_back`;
        NotFoundError naming `where` for a name it has not registered."""
        weight = self._by_caller.get(caller, {}).get(name)
        if weight is None:
            raise NotFoundError(
                f"{where}: no weight named {name[:80]!r} (register it with PUT /weights/{{name}})"
            )
        weight.leases += 1
        return weight

    def give_back(self, weight: Weight) -> None:
        """A lease of `weight` ended: let it go if it was forgotten meanwhile."""
        weight.leases -= 1
        if weight.forgotten and weight.leases == 0:
            self._free(weight)

    def forget(self, caller: Caller | None, name: str) -> None:
        """The caller's weight `name` forgotten (let go once the work using it ends);
        NotFoundError where it has none of that name."""
        mine = self._by_caller.get(caller, {})
        weight = mine.pop(name, None)
        if weight is None:
            raise NotFoundError(f"no weight named {name[:80]!r}")
        if not mine:
            del self._by_caller[caller]
        self._forget(weight)

    def end(self, connection: int) -> None:
        """Every weight registered on the region-socket connection `connection` forgotten (it
        ended, as its regions do)."""
        for caller, mine in list(self._by_caller.items()):
            for name, weight in list(mine.items()):
                if weight.connection == connection:
                    self.forget(caller, name)

    def listed(self, caller: Caller | None) -> list[dict[str, object]]:
        """The caller's weights: name, shape, dtype, bytes."""
        return [w.entry() for w in self._by_caller.get(caller, {}).values()]

    def close(self) -> None:
        """Every weight forgotten (the service is stopping)."""
        for mine in list(self._by_caller.values()):
            for weight in list(mine.values()):
                self._forget(weight)
        self._by_caller.clear()

    def _forget(self, weight: Weight) -> None:
        weight.forgotten = True
        if weight.leases == 0:
            self._free(weight)

    def _free(self, weight: Weight) -> None:
        self.held_bytes -= weight.charge.nbytes
        self.engine.release(weight.buffer)
        weight.charge.close()
