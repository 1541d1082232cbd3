"""Errors as the Open Inference Protocol gives them: `{"error": "..."}` with the status
`/prefill` would answer (and its Retry-After), which tritonclient raises as
InferenceServerException with our message."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

from zen_mla import ERROR_STATUSES, ZenMLAError, status_of

from ..problems import PROBLEM_RESPONSES, problem_headers

__all__ = ["ERROR_RESPONSES", "error_response"]

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {
        "description": f"{HTTPStatus(status).phrase}: the route's error as the Open Inference "
        "Protocol gives it, or problem details where the connection layer refuses the request "
        "before any route (a head too large or too slow, connections over the cap)",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}},
                    "required": ["error"],
                }
            },
            **PROBLEM_RESPONSES[status]["content"],
        },
    }
    for status in ERROR_STATUSES
}
"""The OpenAPI responses of a v2 route: every status zen_mla's table answers an error with, as
`/prefill` documents them; a v2 route answers `{"error"}`, the connection layer (`protocol`)
answers problem details before the request reaches one."""


def error_response(exc: ZenMLAError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": str(exc)},
        status_code=status_of(exc),
        headers=problem_headers(exc) | dict(headers or {}),
    )
