"""Where vLLM's MLA prefill is computed, read once per process from the environment: by the
service (`RemoteSettings`: where it is, how to reach it, what to do when it cannot be reached,
and `service_ready`), or in vLLM's own process (`LocalSettings`, `ZEN_MLA_URL=local`)."""

from __future__ import annotations

import functools
import logging
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx

from ..attention.select import KERNEL_NAMES
from ..client import PrefillClient
from ..envs import (
    DEFAULT_URL,
    LOCAL,
    ZEN_MLA_API_TOKEN,
    ZEN_MLA_FALLBACK,
    ZEN_MLA_KERNEL,
    ZEN_MLA_URL,
)
from ..errors import InvalidInputError

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_URL",
    "LOCAL",
    "LocalSettings",
    "RemoteSettings",
    "Settings",
    "default_settings",
    "healthy",
    "service_ready",
    "settings_from_env",
]

logger = logging.getLogger("zen_mla.vllm")

DEFAULT_CONCURRENCY = 8
_URL_FORM = "http://host:port or https://host:port (port and path optional)"


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """Where the service is and how to reach it.

    `urls`: one base URL or more (requests go to the least loaded, see `PrefillClient`); a
    URL whose host name resolves to several addresses (a headless Service) stands for all.
    `token`: the bearer token, None when the service has none. `health_timeout_s`: how long a
    `/health` check waits. `max_concurrency`: requests one process keeps in flight for
    `prefill_with_context`. `fallback`: while the service cannot be reached, compute each call
    in this process with `zen_mla.ragged_attention` (True) or raise (False).
    `request_timeout_s`: how long one call may wait for the service before it counts as down.
    `probe_interval_s` / `probe_max_interval_s`: the first and the longest wait between two
    `/health` probes of a service that is down (the wait doubles after each failed probe).
    """

    urls: tuple[str, ...] = (DEFAULT_URL,)
    token: str | None = field(default=None, repr=False)  # kept out of logs
    health_timeout_s: float = 3.0
    max_concurrency: int = DEFAULT_CONCURRENCY
    fallback: bool = True
    request_timeout_s: float = 60.0
    probe_interval_s: float = 1.0
    probe_max_interval_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.urls:
            raise InvalidInputError("ZEN_MLA_URL", "one http(s) URL or more", "none")
        for url in self.urls:
            _check_url(url)
        if self.token is not None:
            ZEN_MLA_API_TOKEN.check(self.token)  # the service's rule too
        if self.max_concurrency < 1:
            raise InvalidInputError("max_concurrency", "1 or more", str(self.max_concurrency))
        for name in ("health_timeout_s", "request_timeout_s", "probe_interval_s"):
            if not getattr(self, name) > 0:
                raise InvalidInputError(name, "seconds > 0", str(getattr(self, name)))
        if not self.probe_max_interval_s >= self.probe_interval_s:
            raise InvalidInputError(
                "probe_max_interval_s",
                f"seconds >= probe_interval_s ({self.probe_interval_s})",
                str(self.probe_max_interval_s),
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RemoteSettings:
        """From `ZEN_MLA_URL` (comma-separated for several endpoints; default `DEFAULT_URL`),
        `ZEN_MLA_API_TOKEN` (unset: no token; set but empty: refused, as the service refuses
        it) and `ZEN_MLA_FALLBACK` (`1`, the default: compute locally while the service is
        down; `0`: raise), as `zen_mla.envs` reads them (`environ`: default `os.environ`)."""
        return cls(
            urls=ZEN_MLA_URL.read(environ),
            token=ZEN_MLA_API_TOKEN.read(environ),
            fallback=ZEN_MLA_FALLBACK.read(environ),
        )


def _check_url(url: str) -> None:
    """One endpoint of `ZEN_MLA_URL`: http or https, a host, a port from 1 to 65535 where one is
    given, no spaces. Checked at start: a URL no call can use would otherwise make every call
    fall back to local compute, one warning and then silence."""

    def refused(why: str) -> InvalidInputError:
        return InvalidInputError("ZEN_MLA_URL", _URL_FORM, repr(url), why)

    if any(c.isspace() or not c.isprintable() for c in url):
        raise refused("It holds a space or a control character (percent-encode it)")
    if not url.startswith(("http://", "https://")):
        raise refused("Its scheme must be http:// or https://")
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
    except ValueError as exc:  # an unclosed or invalid [IPv6 address]
        raise refused(f"Its host is not readable ({exc})") from exc
    if not host:
        raise refused("It names no host")
    host_port = parts.netloc.rpartition("@")[2]
    if not host_port.endswith("]") and ":" in host_port:  # "[::1]" has colons and no port
        port = host_port.rpartition(":")[2]
        if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            raise refused(f"Its port must be a number from 1 to 65535, not {port!r}")
    try:
        httpx.URL(url)  # what the client will make of it
    except httpx.InvalidURL as exc:
        raise refused(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class LocalSettings:
    """zen-mla's kernels in this process (vLLM's worker), no service: every call is
    `zen_mla.ragged_attention(..., kernel=kernel)` on the caller's threads. `kernel`: "auto"
    (the default: as `ragged_attention` resolves it on this CPU), "native", "zentorch",
    "torch" or "reference"."""

    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.kernel not in KERNEL_NAMES:
            names = ", ".join(KERNEL_NAMES)
            raise InvalidInputError("ZEN_MLA_KERNEL", f"one of {names}", repr(self.kernel))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LocalSettings:
        """From `ZEN_MLA_KERNEL` (default `auto`)."""
        return cls(kernel=ZEN_MLA_KERNEL.read(environ))


#: where vLLM's MLA prefill is computed
Settings = RemoteSettings | LocalSettings


def settings_from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """`LocalSettings` where `ZEN_MLA_URL` is `local`, else `RemoteSettings`."""
    if [url.lower() for url in ZEN_MLA_URL.read(environ)] == [LOCAL]:
        return LocalSettings.from_env(environ)
    return RemoteSettings.from_env(environ)


@functools.cache
def default_settings() -> Settings:
    """`settings_from_env()`, read once per process (`default_settings.cache_clear()` reads the
    environment again)."""
    return settings_from_env()


def healthy(settings: RemoteSettings) -> bool:
    """Whether any of the settings' endpoints answers `/health` with status "ok", asked now:
    for a URL whose host name resolves to several addresses (replicas behind one name), any
    of them. Never raises."""
    for url in settings.urls:
        try:
            with PrefillClient(
                url, token=settings.token, timeout=settings.health_timeout_s, retries=0
            ) as client:
                if _any_ok(client, url):
                    return True
        except Exception as exc:  # a URL no client takes: not available
            logger.debug("zen-mla at %s is not available: %s", url, exc)
    return False


def _any_ok(client: PrefillClient, url: str) -> bool:
    i, n = 0, 1
    while i < n:
        try:
            health = client.health(i)
        except Exception as exc:  # unreachable, refused, not JSON: all mean "not available"
            logger.debug("zen-mla at %s is not available: %s", url, exc)
        else:
            if health.get("status") == "ok":
                return True
            logger.debug("zen-mla at %s is not ready: /health said %.200r", url, health)
        n = len(client.endpoints)  # a name's addresses, looked up by the first call
        i += 1
    return False


@functools.cache
def service_ready(settings: RemoteSettings) -> bool:
    """`healthy(settings)`, decided once per settings (`service_ready.cache_clear()` asks
    again), with a warning when it is not. Never raises."""
    ready = healthy(settings)
    if not ready:
        logger.warning("zen-mla at %s is not ready", ", ".join(settings.urls))
    return ready
