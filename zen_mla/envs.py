"""The environment variables of the library, the client and the vLLM backend: one table, each
variable's name, default, parser and meaning (as vLLM's `vllm/envs.py` keeps its own). The
service's settings are `service.settings.Settings` fields (pydantic reads those); a rule both read
(`ZEN_MLA_API_TOKEN`'s) is this table's, and the service calls it.

    from zen_mla import envs

    envs.ZEN_MLA_URL.read()          # the endpoints, as the environment says now
    envs.ZEN_MLA_URL.read(environ)   # or as a mapping of one's own says
    envs.VARIABLES                   # every variable, by name (docs/settings.md lists them)

A variable is read when asked, never cached here: a reader that keeps what it read says so
(`zen_mla.vllm.default_settings`, `native_isa`). A value the parser cannot take raises
`InvalidInputError` naming the variable, what it takes and what it was given.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import InvalidInputError

__all__ = [
    "DEFAULT_URL",
    "LOCAL",
    "VARIABLES",
    "ZEN_MLA_API_TOKEN",
    "ZEN_MLA_CACHE_DIR",
    "ZEN_MLA_CALIBRATE",
    "ZEN_MLA_FALLBACK",
    "ZEN_MLA_KERNEL",
    "ZEN_MLA_LATENT",
    "ZEN_MLA_NATIVE_ISA",
    "ZEN_MLA_URL",
    "Variable",
]

T_co = TypeVar("T_co", covariant=True)

#: where the service listens by default (`zen-mla serve`'s host and port), so where a client,
#: `zen-mla health` and the vLLM backend look for it unless told otherwise
DEFAULT_URL = "http://127.0.0.1:8000"
#: `ZEN_MLA_URL=local`: zen-mla's kernels in vLLM's own process, no service
LOCAL = "local"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class Variable(Generic[T_co]):
    """One environment variable: `name`; `default`, its value while unset; `parse`, its value
    from the text set (`parse(name, text)`, raising InvalidInputError naming it); `shown`, the
    default as the docs write it; `meaning`, one line."""

    name: str
    default: T_co
    parse: Callable[[str, str], T_co]
    shown: str
    meaning: str

    def read(self, environ: Mapping[str, str] | None = None) -> T_co:
        """The value `environ` (default: `os.environ`, as it is now) gives the variable."""
        text = (os.environ if environ is None else environ).get(self.name)
        return self.default if text is None else self.parse(self.name, text)

    def check(self, text: str) -> T_co:
        """The value of `text` were the variable set to it: the rule for a value that comes by
        another road (a flag, a settings field, an argument) but means the same."""
        return self.parse(self.name, text)

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable is set to anything but blanks."""
        return bool((os.environ if environ is None else environ).get(self.name, "").strip())


def _endpoints(name: str, text: str) -> tuple[str, ...]:
    """Comma-separated URLs, blanks around each and empty entries dropped; one at least."""
    urls = tuple(u.strip() for u in text.split(",") if u.strip())
    if not urls:
        raise InvalidInputError(name, "one http(s) URL or more", "none")
    return urls


def _token(name: str, text: str) -> str:
    """A bearer token: anything but blanks, for the service (its `api_token` setting) and the
    vLLM backend alike. An empty token would let anyone into a service that took it, and a
    client sending none would get 401 from a guarded service and hide the mistake from an open
    one."""
    if not text.strip():
        raise InvalidInputError(
            name,
            "a non-empty token, or the variable unset",
            "it set but empty",
            "An empty token is no token: a service would let anyone in, a client would send none. "
            "Set a real token, or unset the variable to run without one",
        )
    return text


def _switch(name: str, text: str) -> bool:
    """1 or 0, and their words; anything else refused."""
    said = text.strip().lower()
    if said not in _TRUE + _FALSE:
        raise InvalidInputError(name, "1 or 0 (true/false, yes/no, on/off)", repr(said))
    return said in _TRUE


def _off_words(name: str, text: str) -> bool:
    """Off for 0, false, no or off; on for anything else (a switch that fails open)."""
    return text.strip().lower() not in _FALSE


def _word(default: str) -> Callable[[str, str], str]:
    """The text without blanks around it, `default` where that leaves nothing. What words the
    reader takes is its own rule (the kernels' names, the native kernel's paths)."""

    def parse(name: str, text: str) -> str:
        return text.strip() or default

    return parse


def _lower_word(default: str) -> Callable[[str, str], str]:
    """As `_word`, in lower case."""

    def parse(name: str, text: str) -> str:
        return text.strip().lower() or default

    return parse


def _path(name: str, text: str) -> str | None:
    """A path; None where empty, so the reader's default stands."""
    return text or None


ZEN_MLA_URL: Variable[tuple[str, ...]] = Variable(
    "ZEN_MLA_URL",
    (DEFAULT_URL,),
    _endpoints,
    f"`{DEFAULT_URL}`",
    "the service the vLLM backend calls and `zen-mla health` checks (comma-separated for several "
    "endpoints), or `local`: zen-mla's kernels in vLLM's own process",
)
ZEN_MLA_API_TOKEN: Variable[str | None] = Variable(
    "ZEN_MLA_API_TOKEN",
    None,
    _token,
    "none",
    "the bearer token the vLLM backend sends; set but empty: refused, as the service refuses it",
)
ZEN_MLA_FALLBACK: Variable[bool] = Variable(
    "ZEN_MLA_FALLBACK",
    True,
    _switch,
    "`1`",
    "the vLLM backend computes a call in its own process when the service gives no answer; "
    "`0`: every failure raises",
)
ZEN_MLA_LATENT: Variable[bool] = Variable(
    "ZEN_MLA_LATENT",
    True,
    _switch,
    "`1`",
    "vLLM's CPU_MLA attends cached context from the latent (`kv_c`, `k_pe` and `kv_b_proj`), "
    "in process or through the service, never expanding it; `0`: vLLM expands it as it does",
)
ZEN_MLA_KERNEL: Variable[str] = Variable(
    "ZEN_MLA_KERNEL",
    "auto",
    _word("auto"),
    "`auto`",
    "with `ZEN_MLA_URL=local`, the kernel vLLM's prefill runs on",
)
ZEN_MLA_CALIBRATE: Variable[bool] = Variable(
    "ZEN_MLA_CALIBRATE",
    True,
    _off_words,
    "`1`",
    "`0` (or false, no, off): `auto` takes the first kernel in order instead of measuring",
)
ZEN_MLA_CACHE_DIR: Variable[str | None] = Variable(
    "ZEN_MLA_CACHE_DIR",
    None,
    _path,
    "`~/.cache/zen-mla`",
    "where the calibration is kept (unset or empty: `$XDG_CACHE_HOME/zen-mla`, else "
    "`~/.cache/zen-mla`)",
)
ZEN_MLA_NATIVE_ISA: Variable[str] = Variable(
    "ZEN_MLA_NATIVE_ISA",
    "auto",
    _lower_word("auto"),
    "`auto`",
    "the native kernel's path: `auto` the best this CPU runs, `avx512` (AVX-512 BF16, AMX where "
    "present) or `avx2` (AVX2 and FMA: fp32 products, as on EPYC Zen 2 / Zen 3); one the CPU "
    "lacks, or another word, turns the kernel off, and `/health` says why",
)

#: every variable of the library, the client and the vLLM backend, by name
VARIABLES: dict[str, Variable[object]] = {
    v.name: v
    for v in (
        ZEN_MLA_URL,
        ZEN_MLA_API_TOKEN,
        ZEN_MLA_FALLBACK,
        ZEN_MLA_LATENT,
        ZEN_MLA_KERNEL,
        ZEN_MLA_CALIBRATE,
        ZEN_MLA_CACHE_DIR,
        ZEN_MLA_NATIVE_ISA,
    )
}
