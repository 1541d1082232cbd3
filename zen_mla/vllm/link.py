"""The way to the service for one `RemoteSettings`: its client, whether the service is up, and
the local computation while it is not.

    link = ServiceLink.of(settings)       # one per settings and process, shared by every layer
    out, lse = link.prefill(q, k, v, q_cu, kv_cu, causal=False, return_lse=True, scale=s)
    link.register_weight(name, w_kv_b)    # a layer's kv_b_proj, once
    out, lse = link.prefill_latent(q, kv_c, k_pe, name, q_cu, kv_cu, causal=False, return_lse=True)

While the service answers, every call goes to it. When a call cannot get an answer (the service
is unreachable, answers 503, 504 or 500, times out, or sends something that is not an answer:
the wrong shape or dtype, or NaN or inf for a request of the batch whose inputs are finite), the
link goes down: that call and every one after it is computed here with
`zen_mla.ragged_attention` (`compute_here`: same semantics, same LSE; a call over the latent
cache with `zen_mla.latent_attention` and the weight registered here), and a thread probes
`/health` after 1, 2, 4, ... seconds (at most `probe_max_interval_s`) until it says ok; the next
call goes to the service again. One log line at each change, one per failed probe; `stats`
counts the calls. A call the service refuses as sent (422 bad input, 401 bad token, 413 too
large, ...) is no outage: it raises, as it would here. A 429 (queue full) is computed here, the
link staying up. With `RemoteSettings.fallback` off, a failed call raises instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, ClassVar

import httpx
import torch

from ..attention.latent import latent_attention
from ..client import PrefillClient
from ..errors import InvalidInputError, QueueFullError, RequestRejectedError, ZenMLAError
from ..wire import PrefillOptions
from .context import CheckedPrefiller, PrefillOutput, RaggedTensors, call, check_finite, pool
from .local import compute_here
from .settings import RemoteSettings, healthy
from .stats import stats

__all__ = ["ServiceLink"]

logger = logging.getLogger("zen_mla.vllm")

# What a call to the service can fail with when it got no usable answer. Whatever the client
# raises is one of these (a ZenMLAError, or httpx/OS errors from below it).
_NO_ANSWER = (ZenMLAError, httpx.HTTPError, OSError)


class ServiceLink(CheckedPrefiller):
    """One settings' client and state. A `PrefillClient` is safe to call from several threads;
    `_lock` guards `_client`, `_weights`, `_down_since`, `_local_calls`, `_wait` and `_prober`."""

    _links_lock = threading.Lock()
    _links: ClassVar[dict[RemoteSettings, ServiceLink]] = {}

    @classmethod
    def of(cls, settings: RemoteSettings) -> ServiceLink:
        """The process's link for these settings (vLLM builds one backend per attention layer,
        and 61 layers need not hold 61 connection pools)."""
        with cls._links_lock:
            if settings not in cls._links:
                cls._links[settings] = cls(settings)
            return cls._links[settings]

    def __init__(self, settings: RemoteSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._client = self._new_client()
        # by name, as registered: with the client, with each new client after an outage, and
        # here for the calls computed while the service is down
        self._weights: dict[str, torch.Tensor] = {}
        self._down_since: float | None = None
        self._local_calls = 0  # during the current outage
        self._wait = settings.probe_interval_s
        self._prober: threading.Thread | None = None

    def _new_client(self) -> PrefillClient:
        s = self.settings
        # With the fallback, a call that cannot be answered now is computed here rather than
        # retried: the client's retries wait on Retry-After (up to 30 s each).
        retries = 0 if s.fallback else 3
        timeout = httpx.Timeout(s.request_timeout_s, connect=min(s.request_timeout_s, 5.0))
        return PrefillClient(list(s.urls), token=s.token, timeout=timeout, retries=retries)

    @property
    def client(self) -> PrefillClient:
        with self._lock:
            return self._client

    @property
    def up(self) -> bool:
        """Whether calls go to the service now."""
        with self._lock:
            return self._down_since is None

    def prefill(self, *args: Any, out: torch.Tensor | None = None, **options: Any) -> PrefillOutput:
        """As `PrefillClient.prefill` (its arguments: q, k, v, q_cu_seq_lens[, kv_cu_seq_lens],
        causal, return_lse, scale, and `out` to write into): by the service while it answers,
        else (with the fallback) here. The service's answer is checked (`check_result`,
        `check_finite`) before it counts."""
        tensors: RaggedTensors = (*args, None)[:5]
        opts = PrefillOptions(**options)

        def by_service(client: PrefillClient) -> PrefillOutput:
            result, lse = call(client, tensors, opts, out)
            return result if lse is None else (result, lse)

        return self._answer(by_service, lambda: compute_here(tensors, opts, out=out))

    def register_weight(self, name: str, w_kv_b: torch.Tensor) -> None:
        """Keep `w_kv_b` (a layer's `kv_b_proj` weight, `[H * (Dn + Dv), R]`) as the weight
        `name` of `prefill_latent`: with the client, which registers it with the service the
        first time a call needs it there (and again after a restart), and with every client
        that replaces it after an outage. Registering a name again replaces its weight."""
        with self._lock:
            self._client.register_weight(name, w_kv_b)  # checks it; no I/O
            self._weights[name] = w_kv_b

    def prefill_latent(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        weight: str,
        q_cu_seq_lens: torch.Tensor,
        kv_cu_seq_lens: torch.Tensor | None = None,
        **options: Any,
    ) -> PrefillOutput:
        """As `PrefillClient.prefill_latent` (causal, return_lse, scale, form, precision), the
        weight named as `register_weight` named it: by the service while it answers, else (with
        the fallback) here with `zen_mla.latent_attention` on that weight. The service's answer
        is checked (`check_finite`; its shapes the client checks) before it counts."""

        def by_service(client: PrefillClient) -> PrefillOutput:
            got = client.prefill_latent(
                q, kv_c, k_pe, weight, q_cu_seq_lens, kv_cu_seq_lens, **options
            )
            result, lse = got if isinstance(got, tuple) else (got, None)
            check_finite(result, lse, q, kv_c, k_pe, q_cu_seq_lens, kv_cu_seq_lens)
            return got

        def here() -> PrefillOutput:
            with self._lock:
                w_kv_b = self._weights.get(weight)
            if w_kv_b is None:  # as the client refuses it
                raise InvalidInputError(
                    "weight", "the name of a weight this link registered (register_weight)", weight
                )
            got: PrefillOutput = latent_attention(
                q, kv_c, k_pe, w_kv_b, q_cu_seq_lens, kv_cu_seq_lens, **options
            )
            return got

        return self._answer(by_service, here)

    def _answer(
        self,
        by_service: Callable[[PrefillClient], PrefillOutput],
        here: Callable[[], PrefillOutput],
    ) -> PrefillOutput:
        """One call: `by_service(client)` while the service answers; where it gives no answer
        (or is busy), with the fallback, `here()`; without it, whatever it raised."""
        if not self.settings.fallback:
            got = by_service(self.client)
            stats.add(remote=1)
            return got
        client = self._client_if_up()
        if client is not None:
            try:
                got = by_service(client)
            except (InvalidInputError, RequestRejectedError):
                raise  # the service refused this call as sent (422, 401, 413, ...): no outage
            except QueueFullError:
                pass  # busy, not down: this call here, the next one to the service again
            except _NO_ANSWER as exc:
                self._went_down(client, exc)
            else:
                self._answered()
                return got
        with self._lock:
            self._local_calls += 1
        stats.add(local=1)
        return here()

    def executor(self) -> Executor:
        """What runs a step's pieces: this settings' pool of threads, the pieces in flight to
        the service at once."""
        return pool(self.settings.max_concurrency)

    def _client_if_up(self) -> PrefillClient | None:
        with self._lock:
            if self._down_since is None:
                return self._client
            if self._prober is None or not self._prober.is_alive():
                # a forked child inherits the state but not the thread
                self._start_prober()
            return None

    def _answered(self) -> None:
        stats.add(remote=1)
        with self._lock:
            self._wait = self.settings.probe_interval_s

    def _went_down(self, client: PrefillClient, exc: BaseException) -> None:
        with self._lock:
            if self._down_since is not None or client is not self._client:
                return  # another thread saw it first
            self._down_since = time.monotonic()
            self._local_calls = 0
            self._start_prober()
            wait = self._wait
        stats.add(outages=1)
        logger.warning(
            "zen-mla: the service at %s gave no answer (%s: %s); computing MLA prefill in this "
            "process until it is back (next /health probe in %.0f s)",
            ", ".join(self.settings.urls),
            type(exc).__name__,
            exc,
            wait,
        )

    def _start_prober(self) -> None:  # with _lock held
        self._prober = threading.Thread(target=self._probe, name="zen-mla-probe", daemon=True)
        self._prober.start()

    def _probe(self) -> None:
        while True:
            with self._lock:
                wait = self._wait
            time.sleep(wait)
            if healthy(self.settings):
                break
            with self._lock:
                self._wait = min(self._wait * 2, self.settings.probe_max_interval_s)
                local, next_wait = self._local_calls, self._wait
            logger.info(
                "zen-mla: the service at %s is still down; %d calls computed in this process "
                "so far; next /health probe in %.0f s",
                ", ".join(self.settings.urls),
                local,
                next_wait,
            )
        # A new client: the old one may hold connections and same-host regions of a service
        # that has since restarted.
        fresh = self._new_client()
        with self._lock:
            for name, w_kv_b in self._weights.items():
                fresh.register_weight(name, w_kv_b)
            old, self._client = self._client, fresh
            down_for = time.monotonic() - (self._down_since or time.monotonic())
            local, self._down_since = self._local_calls, None
        old.close()
        logger.warning(
            "zen-mla: the service at %s is back after %.1f s; %d calls were computed in this "
            "process meanwhile",
            ", ".join(self.settings.urls),
            down_for,
            local,
        )
