"""Who a request's caller is, as the operator says: the tenant its bearer token names where the
operator gives tenants tokens of their own (`tenants_file`), else its peer (the address on TCP,
the uid on the region socket). A forwarded address counts only from proxies the operator names
(`forwarded_allow_ips`: uvicorn puts it in the peer's place before the app sees the request);
no header is trusted by default."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from zen_mla import UnauthorizedError
from zen_mla.caller import Caller

__all__ = ["SHARED_TENANT", "Tenants", "TenantsFile", "check_shared_token", "read_tenants"]

#: the tenant of the shared `api_token` where tenants have tokens of their own (no tenant of a
#: file is named so: `NAME`s are `_NAME`)
SHARED_TENANT = "*"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: a tenants file's size cap: it holds names and tokens, not data
MAX_FILE_BYTES = 1 << 20


def read_tenants(path: str) -> dict[str, str]:
    """The tenants of a file of `NAME TOKEN` lines (blank lines and `#` comments skipped), as
    {token: name}; ValueError saying which line is wrong and why."""
    file = Path(path)
    try:
        if file.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"tenants file {path}: expected at most {MAX_FILE_BYTES} bytes")
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"tenants file {path}: cannot be read ({exc})") from None
    tokens: dict[str, str] = {}
    names: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"tenants file {path}, line {number}"
        if len(parts) != 2:
            raise ValueError(f"{where}: expected 'NAME TOKEN', got {len(parts)} words")
        name, token = parts
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{where}: a tenant's name is letters, digits, '.', '_' and '-' (64 at most, "
                f"a letter or digit first), got {name[:70]!r}"
            )
        if name in names:
            raise ValueError(f"{where}: tenant {name!r} is named twice")
        if token in tokens:
            raise ValueError(f"{where}: its token is {tokens[token]!r}'s too; give each its own")
        names.add(name)
        tokens[token] = name
    if not tokens:
        raise ValueError(f"tenants file {path}: names no tenant (expected 'NAME TOKEN' lines)")
    return tokens


class TenantsFile(str):
    """A tenants file's path, with the tenants it named when it was read (`tokens`, as
    `read_tenants` gives them): `Settings` reads the file once, at start, and `Tenants` take
    what it read. Shown, it is the path alone."""

    tokens: dict[str, str]

    def __new__(cls, path: str, tokens: dict[str, str]) -> TenantsFile:
        file = super().__new__(cls, path)
        file.tokens = tokens
        return file

    def __getnewargs__(self) -> tuple[str, dict[str, str]]:  # type: ignore[override]
        return str(self), self.tokens  # a copy keeps its tenants: the file is not read again

    @classmethod
    def read(cls, path: str) -> TenantsFile:
        """The file at `path`, read (ValueError as `read_tenants`)."""
        return cls(path, read_tenants(path))


def check_shared_token(
    shared: str | None, tenants: dict[str, str], where: str = "the tenants file"
) -> None:
    """ValueError where the shared token (`api_token`) is a tenant's too (`tenants`, as
    `read_tenants` gives them, read from `where`): its holder would be charged as that tenant.
    The error names the setting and the tenant, never the token."""
    name = tenants.get(shared) if shared is not None else None
    if name is not None:
        raise ValueError(
            f"api_token (ZEN_MLA_API_TOKEN): expected a token of its own, got the token of "
            f"tenant {name!r} in {where}; whoever holds it would be charged as {name!r}. Give "
            "the shared token another value, or unset it"
        )


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Tenants:
    """The tokens that open the service and the caller each names. Lookups go by the token's
    SHA-256, so how long one takes says nothing of the tokens held. ValueError where the shared
    token is a tenant's too (`check_shared_token`)."""

    def __init__(self, shared: str | None, tenants: dict[str, str] | None = None) -> None:
        check_shared_token(shared, tenants or {})
        self._by_digest: dict[bytes, str] = {_digest(t): n for t, n in (tenants or {}).items()}
        if shared is not None:
            self._by_digest[_digest(shared)] = SHARED_TENANT
        self.named = bool(tenants)  # a caller is a tenant, not a peer
        self.required = bool(self._by_digest)

    @classmethod
    def from_settings(cls, api_token: str | None, tenants_file: str | None) -> Tenants:
        """The tenants of the settings: `tenants_file` as `Settings` read it at start (a
        `TenantsFile`), or a path, read now."""
        if not tenants_file:
            return cls(api_token)
        file = (
            tenants_file
            if isinstance(tenants_file, TenantsFile)
            else TenantsFile.read(tenants_file)
        )
        return cls(api_token, file.tokens)

    def caller(self, token: str | None) -> Caller | None:
        """The caller `token` names: its tenant where tenants have tokens, None where the peer
        is the caller. UnauthorizedError where a token is required and this one is
        missing or opens nothing."""
        if not self.required:
            return None
        name = self._by_digest.get(_digest(token or "")) if token else None
        if name is None:
            raise UnauthorizedError("a valid bearer token is required (Authorization: Bearer ...)")
        return Caller.tenant(name) if self.named else None
