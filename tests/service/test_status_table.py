"""Every protocol's codes come from zen_mla's one table (`ERROR_CODES`): for each class, the
status `/prefill`'s problem details answer, the status a v2 route's `{"error"}` answers, the gRPC
code, the error statuses the app's own OpenAPI document lists, and docs/protocol.md's status
table, each held against the table."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import pytest

from service.app import create_app
from service.kserve.errors import error_response
from service.kserve.grpc_errors import CODES, grpc_error
from service.problems import PROBLEM_JSON, problem, problem_bytes
from service.settings import Settings
from zen_mla import errors
from zen_mla.errors import (
    ERROR_CODES,
    ERROR_STATUSES,
    ErrorCodes,
    InternalError,
    InvalidInputError,
    ZenMLAError,
    codes_of,
)

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
V2_INFER = ("/v2/models/{model}/infer", "/v2/models/{model}/versions/{version}/infer")
# classes the table names no row for: each answered as an InternalError is
UNNAMED = [errors.ZenMLAError, errors.RequestRejectedError, errors.OverloadedError]
UNNAMED += [errors.SharedMemoryUnavailableError, errors.ProtocolError]


def _raised(cls: type[ZenMLAError]) -> ZenMLAError:
    if issubclass(cls, InvalidInputError):
        return cls("q", "[T, H, D]", "[T, H]")
    return cls(f"a {cls.__name__}")


@pytest.mark.parametrize("row", ERROR_CODES, ids=lambda row: row.error.__name__)
def test_every_protocol_answers_a_class_with_its_row(row: ErrorCodes):
    exc = _raised(row.error)
    answer = problem(exc)
    assert answer.status_code == row.http and answer.media_type == PROBLEM_JSON
    assert json.loads(bytes(answer.body))["status"] == row.http
    assert problem_bytes(exc).startswith(f"HTTP/1.1 {row.http} ".encode())
    v2 = error_response(exc)
    assert v2.status_code == row.http and json.loads(bytes(v2.body)) == {"error": str(exc)}
    error = grpc_error(exc)
    assert error.code is grpc.StatusCode[row.grpc]
    assert dict(error.metadata)["zen-mla-status"] == str(row.http)


@pytest.mark.parametrize("cls", UNNAMED, ids=lambda cls: cls.__name__)
def test_a_class_without_a_row_is_answered_as_an_internal_error(cls: type[ZenMLAError]):
    assert cls not in {row.error for row in ERROR_CODES}
    internal = codes_of(InternalError("x"))
    exc = _raised(cls)
    assert codes_of(exc) is internal
    assert problem(exc).status_code == error_response(exc).status_code == internal.http == 500
    assert grpc_error(exc).code is grpc.StatusCode.INTERNAL


def test_the_classes_of_one_status_share_one_grpc_code():
    """docs/protocol.md gives one gRPC code a status, and `CODES` reads it by status."""
    names: dict[int, set[str]] = defaultdict(set)
    for row in ERROR_CODES:
        names[row.http].add(row.grpc)
    assert {status: len(n) for status, n in names.items() if len(n) != 1} == {}
    assert {status: grpc.StatusCode[n.pop()] for status, n in names.items()} == CODES


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    return create_app(Settings(workers=1)).openapi()


def _error_statuses(operation: dict[str, Any]) -> list[int]:
    return sorted(int(code) for code in operation["responses"] if int(code) >= 400)


def test_prefill_documents_every_status_of_the_table_as_problem_details(openapi):
    operation = openapi["paths"]["/prefill"]["post"]
    assert _error_statuses(operation) == list(ERROR_STATUSES)
    for status in ERROR_STATUSES:
        content = operation["responses"][str(status)]["content"]
        assert content[PROBLEM_JSON]["schema"] == {"$ref": "#/components/schemas/Problem"}
    assert "Problem" in openapi["components"]["schemas"]


@pytest.mark.parametrize("path", V2_INFER)
def test_v2_infer_documents_every_status_of_the_table(openapi, path: str):
    operation = openapi["paths"][path]["post"]
    assert _error_statuses(operation) == list(ERROR_STATUSES)
    for status in ERROR_STATUSES:
        content = operation["responses"][str(status)]["content"]
        assert content["application/json"]["schema"]["required"] == ["error"]
        assert PROBLEM_JSON in content  # the connection layer's refusals, before any route


def test_every_v2_route_documents_the_same_statuses(openapi):
    v2 = {
        (method, path): _error_statuses(operation)
        for path, operations in openapi["paths"].items()
        if path.startswith("/v2")
        for method, operation in operations.items()
    }
    assert len(v2) >= 14, sorted(v2)
    assert {key: s for key, s in v2.items() if s != list(ERROR_STATUSES)} == {}


def _docs_status_rows() -> list[tuple[int, str, list[str]]]:
    """docs/protocol.md's status table: each row's status, gRPC code and classes."""
    text = PROTOCOL_MD.read_text()
    section = text[text.index("## Status codes and problem types") :]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| (\d{3}) \| `(\w+)` \| ([^|]*) \|", section, re.M)
    return [(int(status), code, re.findall(r"`(\w+)`", names)) for status, code, names in rows]


def test_the_protocol_docs_status_table_is_the_table():
    rows = _docs_status_rows()
    assert [status for status, _, _ in rows] == list(ERROR_STATUSES)
    by_class = {row.error.__name__: row for row in ERROR_CODES}
    named = [name for _, _, names in rows for name in names]
    assert sorted(named) == sorted(by_class)
    for status, code, names in rows:
        for name in names:
            assert (by_class[name].http, by_class[name].grpc) == (status, code), name
