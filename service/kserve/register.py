"""`POST /v2/systemsharedmemory/region/{name}/register` (`RegisterForm`): a small JSON body
read through the one pipeline as any body is, and a /dev/shm object registered as the caller's
region; nothing computed."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response

from zen_mla import InvalidInputError, WireFormatError, ZenMLAError
from zen_mla.engine import PrefillEngine, SharedBuffer
from zen_mla.regions import CallerShm, SystemShmRegistry, off_error

from ..doors import Door
from ..forms.base import Computed, Expect, Form, RequestRecord
from ..settings import Settings
from ..state import ServiceState, readiness
from . import request as kr
from .errors import error_response

__all__ = ["REGISTER_BYTES", "RegisterForm", "regions_of", "registry_of"]

REGISTER_BYTES = 64 << 10  # a system shared memory registration's JSON, at most


class RegisterForm(Form[Response]):
    """`POST /v2/systemsharedmemory/region/{name}/register`: a small JSON body (key, offset,
    byte_size) read as any body is, and nothing computed."""

    route = "v2_register"
    computes = False

    def __init__(self, state: ServiceState, name: str) -> None:
        self.state = state
        self.name = name
        self.door: Door | None = None

    def expect(self, settings: Settings, door: Door) -> Expect:
        registry_of(self.state)
        self.door = door
        return Expect(REGISTER_BYTES, small=True)

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> None:
        assert isinstance(body, bytes) and self.door is not None
        regions = regions_of(self.state, self.door)  # still there: the body read took a while
        fields = kr.parse_header(body)
        if not isinstance(fields, dict):
            raise WireFormatError("register", "a JSON object", type(fields).__name__)
        unknown = sorted(set(fields) - {"key", "offset", "byte_size"})
        if unknown:
            raise InvalidInputError("register", "key, offset, byte_size", repr(unknown[0])[:40])
        key, offset, size = fields.get("key"), fields.get("offset", 0), fields.get("byte_size")
        regions.register(self.name, key, offset, size)
        return None

    async def answer(self, result: Computed | None, record: RequestRecord) -> Response:
        return JSONResponse({})

    def refuse(self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]) -> Response:
        return error_response(exc, headers)

    def hung_up(self) -> Response:
        return Response(status_code=499)


def registry_of(state: ServiceState) -> SystemShmRegistry:
    """The system shared memory registry, where it is on and made (ForbiddenError, 503)."""
    if not state.settings.system_shm:
        raise off_error()
    if state.system_shm is None:  # made as the engine starts
        raise readiness(state).error(retry_after=5)
    return state.system_shm


def regions_of(state: ServiceState, door: Door) -> CallerShm:
    """The regions of `door`'s caller (its token checked already: `Door.authorize`), where
    system shared memory is on and made (as `registry_of`)."""
    return registry_of(state).of(door.caller)
