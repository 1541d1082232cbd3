"""The service's configuration: one typed object, built once (environment, then CLI flags)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from zen_mla.envs import ZEN_MLA_API_TOKEN

from .tenants import TenantsFile, check_shared_token


class Settings(BaseSettings):
    """Every field is also the environment variable `ZEN_MLA_<FIELD>` (upper case) and, secrets
    apart, the flag `zen-mla serve --<field>` (`_` as `-`), which service/cli.py makes from the
    field's type and description (its help)."""

    # hide_input_in_errors: a refusal would print what was given, api_token's value among it
    model_config = SettingsConfigDict(
        env_prefix="ZEN_MLA_", frozen=True, extra="forbid", hide_input_in_errors=True
    )

    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 only on purpose")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    uds: str | None = Field(None, description="serve on this Unix socket instead of TCP")
    grpc_port: int = Field(
        8001,
        ge=0,
        le=65535,
        description="TCP port of the Open Inference Protocol over gRPC (KServe v2's "
        "GRPCInferenceService), on the same host; 0: off",
    )
    workers: int | Literal["auto"] = Field(
        "auto", description="'auto' (one worker per CCX) or a number of workers"
    )
    smt: bool = Field(False, description="also run threads on SMT siblings")
    api_token: SecretStr | None = Field(
        None,
        description="bearer token guarding every route but health, metrics and metadata, and "
        "the region socket",
    )
    tenants_file: str | None = Field(
        None,
        description="tenant tokens, one 'NAME TOKEN' a line: a request's client is the tenant "
        "its bearer token names, each with its own share (the api_token, where set, is one more "
        "tenant); off: a client is its peer address",
    )
    forwarded_allow_ips: str | None = Field(
        None,
        description="proxies (addresses or networks, comma-separated; '*' any) whose "
        "X-Forwarded-For names the client; off: no forwarded header is trusted from anywhere",
    )
    max_body_bytes: int = Field(1 << 30, gt=0, description="413 above this Content-Length")
    max_queue: int = Field(
        8, ge=1, description="requests whose body is in, queued or computing at once; 429 above"
    )
    max_uploads: int = Field(
        32,
        ge=1,
        description="bodies being read at once; above, a new one cuts off the slowest past its "
        "grace (408), else 429",
    )
    max_inflight_bytes: int = Field(
        4 << 30,
        gt=0,
        description="bytes the requests hold: bodies as they arrive, then each request's kernel "
        "memory and answer until its last byte is sent; 429 above",
    )
    min_body_rate: float = Field(
        1e6,
        ge=0,
        description="bytes/s a body must arrive at and an answer be read at, on average after "
        "the grace; a body below is answered 408, an answer cut; 0: off",
    )
    body_grace_s: float = Field(
        2.0, ge=0, description="time before a body's or an answer's rate counts"
    )
    max_header_bytes: int = Field(
        64 << 10, ge=1024, description="request line and headers; 431 above"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="a connection's headers must be in within this; 408 and closed"
    )
    max_connections: int = Field(
        1024,
        ge=1,
        description="open connections, HTTP's and gRPC's together; 503 above (also capped below "
        "the fd limit)",
    )
    grpc_max_connections: int = Field(
        256,
        ge=1,
        description="of max_connections (as the fd limit lowers it), those gRPC may hold, at "
        "most half (HTTP keeps the rest); a connection past it is closed at once",
    )
    grpc_max_streams: int = Field(
        100,
        ge=1,
        description="calls open at once on one gRPC connection (HTTP/2 MAX_CONCURRENT_STREAMS); "
        "a stream past it is refused until one ends",
    )
    grpc_max_calls: int = Field(
        256,
        ge=1,
        description="gRPC calls open at once, shared between clients as the queue is; a call "
        "past its client's share is RESOURCE_EXHAUSTED before its message is read",
    )
    grpc_max_message_bytes: int = Field(
        256 << 20,
        gt=0,
        description="a gRPC message's most bytes (also at most max_body_bytes and a third of "
        "max_inflight_bytes): grpc reads a message whole, held three times over, before its "
        "size is known, so every call that reads one is charged three times this first",
    )
    grpc_max_resets: int = Field(
        100,
        ge=1,
        description="calls a gRPC connection may cancel within a second of opening them (once "
        "they are over half of its calls); past it the connection is closed (HTTP/2 rapid reset)",
    )
    fd_reserve: int = Field(
        256, ge=0, description="descriptors kept for the pool and the process, off the cap"
    )
    linger_s: float = Field(
        2.0, ge=0, description="after an early answer, unread input is discarded this long"
    )
    deadline_s: float = Field(60.0, gt=0, description="504 and the work abandoned after this")
    max_work: int = Field(
        1 << 41, gt=0, description="cap on H * Dqk * (visible query-key pairs) per request"
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, in-flight work gets this")
    shared_memory: bool = Field(
        True, description="offer same-host regions (memfds handed over a Unix socket)"
    )
    shm_socket: str | None = Field(
        None,
        description="the regions' socket; default: next to --uds, else "
        "/tmp/zen-mla-<uid>/regions-<port>.sock",
    )
    shm_max_regions: int = Field(64, ge=1, description="regions one client may hold")
    shm_max_bytes: int = Field(
        64 << 30,
        ge=1,
        description="bytes of regions one client (one uid, over all its connections) may hold",
    )
    shm_max_total_bytes: int | None = Field(
        None,
        ge=1,
        description="bytes of regions of all region-socket clients together; default: the "
        "host's memory",
    )
    shm_max_clients: int = Field(
        64, ge=1, description="region-socket connections that said hello, at once"
    )
    shm_max_waiting: int = Field(
        16,
        ge=1,
        description="region-socket connections yet to say hello; above, the oldest is closed",
    )
    system_shm: bool = Field(
        False,
        description="the Open Inference Protocol's system shared memory: clients name /dev/shm "
        "objects of this service's user for it to read and write",
    )
    system_shm_max_regions: int = Field(
        64, ge=1, description="system shared memory regions registered at once"
    )
    system_shm_max_bytes: int = Field(
        64 << 30, ge=1, description="bytes of system shared memory regions mapped at once"
    )
    max_seqs: int = Field(
        8192, ge=1, description="sequences (B) in one request; 422 above, before any work"
    )
    max_weights: int = Field(
        128, ge=1, description="weights (kv_b_proj) registered at once, per caller"
    )
    max_weight_bytes: int = Field(
        256 << 20, ge=1, description="one weight registration's body (safetensors); 413 above"
    )
    linger_bytes: int = Field(
        256 << 20,
        ge=0,
        description="after an early answer, at most this much unread input is discarded",
    )
    max_json_bytes: int = Field(
        16 << 20,
        ge=1024,
        description="the JSON part of a /v2 infer request (its inference header); 413 above",
    )
    http: Literal["httptools", "h11"] = Field("httptools", description="uvicorn's HTTP parser")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="the service's log level"
    )

    @field_validator("api_token")
    @classmethod
    def _token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            ZEN_MLA_API_TOKEN.check(value.get_secret_value())  # the vLLM backend's rule too
        return value

    @field_validator("tenants_file")
    @classmethod
    def _tenants(cls, value: str | None) -> str | None:
        # read once, here: a file that cannot be read or parsed stops the start, and what was
        # read goes with the path (`Tenants.from_settings` takes it)
        return None if value is None else TenantsFile.read(value)

    @model_validator(mode="after")
    def _budget(self) -> Settings:
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_inflight_bytes: expected at least max_body_bytes ({self.max_body_bytes}), "
                f"got {self.max_inflight_bytes}; a body of the largest allowed size would "
                "always be refused"
            )
        return self

    @model_validator(mode="after")
    def _ports(self) -> Settings:
        if self.grpc_port and self.uds is None and self.grpc_port == self.port:
            raise ValueError(
                f"grpc_port: expected a port other than the HTTP port {self.port}, or 0 (off)"
            )
        return self

    @model_validator(mode="after")
    def _shared_token(self) -> Settings:
        if self.api_token is not None and isinstance(self.tenants_file, TenantsFile):
            check_shared_token(
                self.api_token.get_secret_value(),
                self.tenants_file.tokens,
                f"tenants file {self.tenants_file}",
            )
        return self

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
    def regions_socket(self) -> str | None:
        """Where the regions' socket listens, None when shared memory is off."""
        if not self.shared_memory:
            return None
        if self.shm_socket:
            return self.shm_socket
        if self.uds:
            return f"{self.uds}.regions"
        return f"/tmp/zen-mla-{os.getuid()}/regions-{self.port}.sock"

    @property
    def worker_count(self) -> int | None:
        return None if self.workers == "auto" else int(self.workers)
