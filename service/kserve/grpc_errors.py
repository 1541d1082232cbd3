"""Errors as gRPC statuses: the status code zen_mla's table gives the error (`codes_of`), the
message as on HTTP, and trailing metadata: the problem's type, its HTTP status, and for a 429 or
503 the retry hint, as `retry-after` seconds and as google.rpc.RetryInfo in the status details
(`grpc-status-details-bin`, which gRPC's own retry support and `grpcio-status` read)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from zen_mla import ERROR_CODES, OverloadedError, ZenMLAError, codes_of

__all__ = ["CODES", "GrpcError", "grpc_error"]

CODES: dict[int, grpc.StatusCode] = {row.http: grpc.StatusCode[row.grpc] for row in ERROR_CODES}
"""The gRPC status code of each HTTP status the service answers an error with, read from
zen_mla's table (the classes of one status share a code)."""

Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass(frozen=True, slots=True)
class GrpcError:
    """A call's error status: what `context.abort` sends."""

    code: grpc.StatusCode
    message: str
    metadata: Metadata


def grpc_error(exc: ZenMLAError) -> GrpcError:
    codes = codes_of(exc)
    status, code = codes.http, grpc.StatusCode[codes.grpc]
    message = str(exc)
    metadata: list[tuple[str, str | bytes]] = [
        ("zen-mla-problem", f"urn:zen-mla:problem:{type(exc).__name__}"),
        ("zen-mla-status", str(status)),
    ]
    if isinstance(exc, OverloadedError) and exc.retry_after is not None:
        seconds = max(1, math.ceil(exc.retry_after))
        metadata.append(("retry-after", str(seconds)))
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=seconds)))
        details = status_pb2.Status(code=code.value[0], message=message, details=[detail])
        metadata.append(("grpc-status-details-bin", details.SerializeToString()))
    return GrpcError(code, message, tuple(metadata))
