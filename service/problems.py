"""Errors as RFC 9457 problem details (`application/problem+json`), from zen_mla's one table."""

from __future__ import annotations

import math
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from zen_mla._errors import InvalidInputError, OverloadedError, ZenMLAError, status_of

PROBLEM_JSON = "application/problem+json"


class Problem(BaseModel):
    """RFC 9457 problem details; 422s add which tensor broke which rule."""

    type: str
    title: str
    status: int
    detail: str
    tensor: str | None = None
    expected: str | None = None
    got: str | None = None
    request_id: str | None = None


def problem(
    exc: ZenMLAError, request_id: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    status = status_of(exc)
    body: dict[str, Any] = {
        "type": f"urn:zen-mla:problem:{type(exc).__name__}",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": str(exc),
    }
    if isinstance(exc, InvalidInputError):
        body |= {"tensor": exc.name, "expected": exc.expected, "got": exc.got}
    if request_id is not None:
        body["request_id"] = request_id
    headers = dict(headers or {})
    if isinstance(exc, OverloadedError) and exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return JSONResponse(body, status_code=status, headers=headers, media_type=PROBLEM_JSON)


PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {
        "description": HTTPStatus(status).phrase,
        "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }
    for status in (400, 401, 411, 413, 415, 422, 429, 500, 503, 504)
}
