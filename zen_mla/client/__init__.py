"""Clients of the zen-mla service, on httpx: `PrefillClient` and `AsyncPrefillClient`.

    with PrefillClient("http://cpu-node:8000") as client:  # none given: zen_mla.envs.DEFAULT_URL
        out, lse = client.prefill(q, k, v, q_cu_seq_lens, return_lse=True)

`prefill` takes and returns what `zen_mla.ragged_attention` does; tensors on another device
(CUDA) go over as CPU tensors and come back on the caller's device. Errors arrive as the same
zen_mla exceptions the service raised; 429 and 503 are retried after `Retry-After`, a few times.
A request the server never read (its 408, or a kept connection closed before any byte of an
answer: the service closes idle ones at its connection cap, which may cross a request going out)
is sent once more on another connection, within the call's timeout; one whose answer began is
never sent again, to no endpoint.

`timeout` bounds a whole call (connect, send, wait, read, and the retries with their waits), not
each read: past it, DeadlineExceededError. Every answer is checked against its request (`out`
[Tq, H, Dv] in v's dtype, `lse` [H, Tq] float32 only when asked, no other names) and read only
up to the bytes the request can need; an answer that breaks the protocol is a ProtocolError.
Every failure is a ZenMLAError.

Given several endpoints (`PrefillClient(["http://a:8000", "http://b:8000"])`), each request goes
to the one with the least outstanding work (attention pairs in flight); an unreachable or
overloaded endpoint is passed over for another. A URL whose host name resolves to several
addresses (a Kubernetes headless Service) is balanced over all of them, each address an endpoint
of its own; the name is looked up again every `resolve_every` seconds (docs/clients.md). An
endpoint that failed gets work again only once its `/health/ready` answers 200.

On the service's host, tensors need not cross a socket: with `shared_memory=None` (the default)
the client uses same-host regions wherever the service offers them and their socket can be
reached from here (a call for which the service refuses a region now, its byte budget for this
user spent say, goes over TCP with the same answer), `True` requires them, `False` never uses
them (asked again while the service starts, and once it restarted: `_offers`). A request's
tensors are then copied once into a region the client holds (or not at all, for tensors made
with `empty()`), and the workers read them and write the results there.

The modules behind it: `_base` (all the twins share but I/O: the client's state, one call across
its attempts), `_inputs` (a call's tensors checked), `_endpoints` (which endpoint a call goes
to, and when one that failed is ready again), `_names` (the addresses a name stands for, looked
up again), `_retry` (what a failed attempt leads to: its zen_mla error, and whether, where and when
the call is tried again), `_deadline` (one call's deadline), `_resend` (when an exchange is sent
again), `_answers` (answers read and checked, problems as exceptions), `_memory` (large answers'
memory, reused across calls), `_offers` (each endpoint's same-host regions, and when to ask
again), `_sync` and `_async` (their I/O), `_transport` (the blocking client's sockets, bounded
by the call's deadline).
"""

from ._async import AsyncPrefillClient
from ._sync import PrefillClient

__all__ = ["AsyncPrefillClient", "PrefillClient"]
