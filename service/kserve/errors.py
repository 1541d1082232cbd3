"""Errors as the Open Inference Protocol gives them: `{"error": "..."}` with the status
`/prefill` would answer (and its Retry-After), which tritonclient raises as
InferenceServerException with our message."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from zen_mla import ZenMLAError, status_of

from ..problems import problem_headers

__all__ = ["ERROR_RESPONSES", "error_response"]

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {
        "description": "an error, as the Open Inference Protocol gives it",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}},
                    "required": ["error"],
                }
            }
        },
    }
    for status in (400, 401, 403, 404, 408, 411, 413, 415, 422, 429, 500, 503, 504)
}


def error_response(exc: ZenMLAError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": str(exc)},
        status_code=status_of(exc),
        headers=problem_headers(exc) | dict(headers or {}),
    )
