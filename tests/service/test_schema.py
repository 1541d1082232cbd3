"""Schema-driven tests: schemathesis generates requests for every route of the app's own
OpenAPI document, in process (the app and its worker pool run inside the test process), and
checks every answer against the document: documented status, content type, no 5xx."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from service.app import create_app
from service.settings import Settings
from zen_mla.engine import EngineConfig, PrefillEngine
from zen_mla.pool import PoolConfig

pytestmark = pytest.mark.slow  # a worker pool runs in this process, and the fuzzing takes long

ENGINE = PrefillEngine(EngineConfig(PoolConfig(workers=1)))
APP = create_app(Settings(workers=1, max_body_bytes=1 << 20, max_queue=64), engine=ENGINE)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def running_pool():
    """schemathesis enters the app's lifespan per call: the engine lives outside it."""
    with ENGINE:
        yield


@schema.parametrize()
@settings(
    max_examples=int(os.environ.get("SCHEMATHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_api(case):
    # A binary body's schema cannot say what a valid safetensors request is, so "schema-valid
    # data must be accepted" does not apply; every other check does (no 5xx, documented
    # status codes and content types, conforming bodies).
    case.call_and_validate(excluded_checks=[positive_data_acceptance])
