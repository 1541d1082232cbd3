"""The service's configuration: one typed object, built once (environment, then CLI flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every field is also the environment variable `ZEN_MLA_<FIELD>` (upper case)."""

    model_config = SettingsConfigDict(env_prefix="ZEN_MLA_", frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 only on purpose")
    port: int = Field(8000, ge=0, le=65535)
    uds: str | None = Field(None, description="serve on this Unix socket instead of TCP")
    workers: int | Literal["auto"] = Field("auto", description="'auto': one per CCX")
    smt: bool = Field(False, description="also run threads on SMT siblings")
    api_token: SecretStr | None = Field(None, description="bearer token guarding /prefill")
    max_body_bytes: int = Field(1 << 30, gt=0, description="413 above this Content-Length")
    max_queue: int = Field(8, ge=1, description="requests admitted at once; 429 above")
    deadline_s: float = Field(60.0, gt=0, description="504 and the work abandoned after this")
    max_work: int = Field(
        1 << 41, gt=0, description="cap on H * Dqk * (visible query-key pairs) per request"
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, in-flight work gets this")
    http: Literal["httptools", "h11"] = "httptools"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: object) -> object:
        if isinstance(value, str) and value != "auto":
            try:
                return int(value)
            except ValueError:
                raise ValueError("workers must be 'auto' or a whole number") from None
        return value

    @property
    def worker_count(self) -> int | None:
        return None if self.workers == "auto" else int(self.workers)
