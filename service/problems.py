"""Errors as RFC 9457 problem details (`application/problem+json`), from zen_mla's one table."""

from __future__ import annotations

import json
import math
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from zen_mla import (
    ERROR_STATUSES,
    InvalidInputError,
    OverloadedError,
    UnauthorizedError,
    ZenMLAError,
    status_of,
)

PROBLEM_JSON = "application/problem+json"


class Problem(BaseModel):
    """RFC 9457 problem details; 422s add which tensor broke which rule, and how to fix it
    where the message says (`hint`)."""

    type: str
    title: str
    status: int
    detail: str
    tensor: str | None = None
    expected: str | None = None
    got: str | None = None
    hint: str | None = None
    request_id: str | None = None


def problem(
    exc: ZenMLAError, request_id: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = problem_body(exc, request_id)
    headers = problem_headers(exc) | dict(headers or {})
    return JSONResponse(body, status_code=body["status"], headers=headers, media_type=PROBLEM_JSON)


def problem_body(exc: ZenMLAError, request_id: str | None = None) -> dict[str, Any]:
    status = status_of(exc)
    body: dict[str, Any] = {
        "type": f"urn:zen-mla:problem:{type(exc).__name__}",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": str(exc),
    }
    if isinstance(exc, InvalidInputError):
        body |= {"tensor": exc.name, "expected": exc.expected, "got": exc.got}
        if exc.hint:
            body["hint"] = exc.hint  # the client rebuilds the exception with it
    if request_id is not None:
        body["request_id"] = request_id
    return body


def problem_headers(exc: ZenMLAError) -> dict[str, str]:
    headers = {}
    if isinstance(exc, OverloadedError) and exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, UnauthorizedError):
        headers["WWW-Authenticate"] = 'Bearer realm="zen-mla"'  # RFC 6750
    return headers


def problem_bytes(exc: ZenMLAError) -> bytes:
    """A whole HTTP/1.1 answer with `Connection: close`, for the protocol layer, which answers
    before (or instead of) a request reaching the app."""
    body = json.dumps(problem_body(exc)).encode()
    status = status_of(exc)
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"]
    head += [f"{k}: {v}" for k, v in problem_headers(exc).items()]
    head += [
        f"content-type: {PROBLEM_JSON}",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {
        "description": HTTPStatus(status).phrase,
        "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }
    for status in ERROR_STATUSES
}
"""The OpenAPI responses of a route that answers errors as problem details: every status zen_mla's
table answers an error with. The connection layer (`protocol`) answers some of them (a head too
large or too slow, connections over the cap) before any route is reached."""
