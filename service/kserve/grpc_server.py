"""The Open Inference Protocol over gRPC: KServe v2's `inference.GRPCInferenceService`, served by
grpc.aio on the service's event loop, on its own port (`grpc_port`).

Every method is registered as a stream of requests, so the service sees the call before its
message and reads it only when it chooses. Each call first takes its caller's place among the
calls open and counts on its connection (`grpc_limits`). `ServerLive`, `ServerReady` and
`ServerMetadata`, whose requests have no fields, are answered without reading their message. The
others go through the one pipeline (`pipeline.serve`, by a `doors.GrpcDoor`): the token, then
admission, with what grpc may hold to read a message (three copies of its one limit for every
method, `doors.COPIES`) charged to the caller before the message is asked for, shares, deadline,
queue, metrics and log line; `ModelInfer` computes, `SystemSharedMemoryRegister` registers, and
the small ones (`MethodForm`: model readiness and metadata, shared memory status and
unregistration) answer from a message of at most `REGISTER_BYTES`. Each writes its one response
itself, its bytes charged to the caller until the call ends (as an HTTP answer's). Errors are
the HTTP ones as gRPC statuses (`grpc_errors`). Methods not served (streaming, model repository,
CUDA shared memory, statistics, trace and log settings) answer UNIMPLEMENTED.

grpc's transport enforces the limits a request's head and a connection have on HTTP: the message
limit (`grpc_infer.message_limit`, refused before it is read: RESOURCE_EXHAUSTED; one limit for
every method, as grpc's server takes none per method, hence the charge above), metadata size,
the time to complete a connection's handshake, the bytes a stream takes in before its message is
asked for (HTTP/2's initial window), streams per connection (`grpc_max_streams`, counted until
grpc has let go of a stream, so a reset stream holds its place until then) and open connections
(gRPC's part of the one connection budget, `server.connection_caps`); a connection idle that
long is closed, and any after `CONNECTION_AGE_S` (clients reconnect by themselves)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2 as pb

from zen_mla import ZenMLAError, __version__
from zen_mla.engine import PrefillEngine, SharedBuffer

from ..doors import Door, GrpcDoor, trusted_proxies
from ..forms.base import Computed, Expect, Form, RequestRecord
from ..memory import Trim
from ..pipeline import serve
from ..settings import Settings
from ..state import ServiceState, readiness
from . import request as kr
from .grpc_errors import GrpcError, grpc_error
from .grpc_infer import (
    GrpcAnswer,
    GrpcInferForm,
    GrpcRegisterForm,
    GrpcReply,
    message_limit,
)
from .grpc_limits import CallLimits
from .grpc_wire import parse
from .register import REGISTER_BYTES, regions_of

__all__ = ["SERVICE", "GrpcListenError", "MethodForm", "grpc_options", "start_grpc"]

SERVICE = "inference.GRPCInferenceService"
#: a connection's life: then GOAWAY (clients reconnect, and re-resolve a name to its replicas),
#: and closed once its calls end or `deadline_s` later, whatever a caller leaves unread
CONNECTION_AGE_S = 300
M = TypeVar("M", bound=Message)
Context = Any  # grpc.aio.ServicerContext


class GrpcListenError(RuntimeError):
    """The gRPC port cannot be listened on (in use, or not this host's)."""


def grpc_options(settings: Settings, connections: int) -> list[tuple[str, int]]:
    """The transport's limits, from the service's settings and gRPC's part of the connection
    budget (`connections`)."""
    head_ms = int(settings.header_timeout_s * 1000)
    return [
        ("grpc.max_receive_message_length", message_limit(settings)),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_metadata_size", settings.max_header_bytes),
        ("grpc.absolute_max_metadata_size", settings.max_header_bytes),
        ("grpc.server_handshake_timeout_ms", head_ms),
        ("grpc.max_connection_idle_ms", head_ms),
        ("grpc.max_allowed_incoming_connections", connections),
        ("grpc.max_concurrent_streams", settings.grpc_max_streams),
        # A stream's window before its message is asked for stays HTTP/2's initial 64 KiB: BDP
        # probing grows it for every stream to the connection's bandwidth-delay product, and
        # streams refused unread had taken in megabytes each (a stream being read has its window
        # opened for its message all the same).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.max_connection_age_ms", CONNECTION_AGE_S * 1000),
        ("grpc.max_connection_age_grace_ms", int(settings.deadline_s * 1000)),
        ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener on it
    ]


async def start_grpc(state: ServiceState, connections: int) -> grpc.aio.Server:
    """The gRPC server for `state`, holding at most `connections` connections, listening
    (GrpcListenError where its port cannot be bound)."""
    s = state.settings
    server = grpc.aio.server(options=grpc_options(s, connections))
    server.add_generic_rpc_handlers((_handlers(state, connections),))
    host = f"[{s.host}]" if ":" in s.host else s.host
    try:
        server.add_insecure_port(f"{host}:{s.grpc_port}")
    except RuntimeError:
        raise GrpcListenError(
            f"gRPC: cannot listen on {host}:{s.grpc_port} (in use?); another --grpc-port, or 0 "
            "to turn gRPC off"
        ) from None
    await server.start()
    return server


async def _send(context: Context, answer: GrpcAnswer) -> None:
    """The answer written: an error's status, or the response, its bytes charged to its caller
    until the call ends (grpc holds a response its caller leaves unread, and has no way to cut
    it short: the connection's age bounds it, `CONNECTION_AGE_S` and the grace after). None:
    the caller is gone, nothing to send."""
    if isinstance(answer, GrpcError):
        await context.abort(answer.code, answer.message, answer.metadata)  # raises
    if not isinstance(answer, GrpcReply):
        return
    loop = asyncio.get_running_loop()
    context.add_done_callback(lambda _: loop.call_soon_threadsafe(answer.release))
    await context.write(answer.message)


def _discard_answer(state: ServiceState) -> Callable[[asyncio.Future[GrpcAnswer]], None]:
    """A done callback for a call's pipeline task whose caller went: its answer's bytes back."""

    def done(task: asyncio.Future[GrpcAnswer]) -> None:
        state.abandoned.discard(task)
        if not task.cancelled() and task.exception() is None:
            answer = task.result()
            if isinstance(answer, GrpcReply):
                answer.release()

    return done


class MethodForm(Form[GrpcAnswer]):
    """A method with a small request message, as a form of the one pipeline that computes
    nothing: its message (at most `REGISTER_BYTES`) parsed as `kind` and answered by `call`,
    which is given the door too (whose caller the answer may be scoped to)."""

    computes = False

    def __init__(
        self, route: str, kind: type[M], call: Callable[[M, Door], Awaitable[Message]]
    ) -> None:
        self.route = route
        self.kind = kind
        self.call: Callable[[Any, Door], Awaitable[Message]] = call
        self.response: Message | None = None
        self.door: Door | None = None

    def expect(self, settings: Settings, door: Door) -> Expect:
        self.door = door
        return Expect(REGISTER_BYTES, small=True)

    async def decode(
        self, body: SharedBuffer | bytes, engine: PrefillEngine, record: RequestRecord
    ) -> None:
        assert isinstance(body, bytes) and self.door is not None
        self.response = await self.call(parse(self.kind, body), self.door)

    async def answer(self, result: Computed | None, record: RequestRecord) -> GrpcAnswer:
        assert self.response is not None
        return GrpcReply(self.response.SerializeToString())

    def refuse(
        self, exc: ZenMLAError, record: RequestRecord, headers: dict[str, str]
    ) -> GrpcAnswer:
        return grpc_error(exc)

    def hung_up(self) -> GrpcAnswer:
        return None


def _handlers(state: ServiceState, connections: int) -> grpc.GenericRpcHandler:
    s = state.settings
    big_json = asyncio.Semaphore(1)  # as on HTTP: one large request head parsed at a time
    proxies = trusted_proxies(s.forwarded_allow_ips)
    limit = message_limit(s)
    limits = CallLimits(state.admission, s, connections)
    trim = Trim()

    def method(handle: Callable[[GrpcDoor], Awaitable[None]]) -> grpc.RpcMethodHandler:
        """`handle` as a method: the call holds its place among the calls open (refused
        unread past its caller's share) while it runs."""

        async def handler(_: Any, context: Context) -> None:
            door = GrpcDoor(context, proxies, limit)
            door.identify(state.tenants)  # charged to the tenant a good token names
            try:
                with limits.held(door):
                    await handle(door)
            except ZenMLAError as exc:
                await _send(context, grpc_error(exc))

        return grpc.stream_stream_rpc_method_handler(handler)

    def unread(answer: Callable[[], Message]) -> grpc.RpcMethodHandler:
        """A method whose request has no fields, answered without reading its message (grpc
        holds at most a stream's window of it, dropped with the call)."""

        async def handle(door: GrpcDoor) -> None:
            await door.context.write(answer().SerializeToString())

        return method(handle)

    async def through_pipeline(door: GrpcDoor, form: Form[GrpcAnswer]) -> None:
        """`form`'s call through the one pipeline, in a task of its own: grpc cancels a
        handler whose caller goes, and the pipeline must see a hang-up (its work, still read
        by a worker, handed to the task that waits it out), never a cancelled request that
        gives its buffers back under a running worker."""
        task = asyncio.ensure_future(serve(state, door, form))
        try:
            answer = await asyncio.shield(task)
        except asyncio.CancelledError:
            door.hang_up()
            state.abandoned.add(task)
            task.add_done_callback(_discard_answer(state))
            raise
        trim.after(door.size)  # its bytes are let go: the pipeline holds none past its answer
        await _send(door.context, answer)

    def small(route: str, kind: type[M], call: Callable[[M, Door], Awaitable[Message]]) -> Any:
        return method(lambda door: through_pipeline(door, MethodForm(route, kind, call)))

    def ready() -> bool:
        return readiness(state).ready

    def server_metadata() -> Message:
        extensions = ["binary_tensor_data", "parameters"]
        if s.system_shm:
            extensions.append("system_shared_memory")
        return pb.ServerMetadataResponse(name="zen-mla", version=__version__, extensions=extensions)

    async def model_ready(msg: pb.ModelReadyRequest, _: Door) -> Message:
        kr.check_model(msg.name, msg.version)
        return pb.ModelReadyResponse(ready=ready())

    async def model_metadata(msg: pb.ModelMetadataRequest, _: Door) -> Message:
        kr.check_model(msg.name, msg.version)
        meta = kr.model_metadata()

        def tensors(items: Sequence[dict[str, Any]]) -> list[Any]:
            return [
                pb.ModelMetadataResponse.TensorMetadata(
                    name=t["name"], datatype=t["datatype"], shape=t["shape"]
                )
                for t in items
            ]

        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=tensors(meta["inputs"]),
            outputs=tensors(meta["outputs"]),
        )

    async def shm_status(msg: pb.SystemSharedMemoryStatusRequest, door: Door) -> Message:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in regions_of(state, door).status(msg.name or None):
            entry = response.regions[str(region["name"])]
            entry.name, entry.key = str(region["name"]), str(region["key"])
            entry.offset, entry.byte_size = int(region["offset"]), int(region["byte_size"])  # type: ignore[call-overload]
        return response

    async def shm_unregister(msg: pb.SystemSharedMemoryUnregisterRequest, door: Door) -> Message:
        regions_of(state, door).unregister(msg.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    methods = {
        "ServerLive": unread(lambda: pb.ServerLiveResponse(live=True)),
        "ServerReady": unread(lambda: pb.ServerReadyResponse(ready=ready())),
        "ServerMetadata": unread(server_metadata),
        "ModelReady": small("grpc_model", pb.ModelReadyRequest, model_ready),
        "ModelMetadata": small("grpc_model", pb.ModelMetadataRequest, model_metadata),
        "ModelInfer": method(lambda door: through_pipeline(door, GrpcInferForm(state, big_json))),
        "SystemSharedMemoryStatus": small(
            "grpc_shm", pb.SystemSharedMemoryStatusRequest, shm_status
        ),
        "SystemSharedMemoryRegister": method(
            lambda door: through_pipeline(door, GrpcRegisterForm(state))
        ),
        "SystemSharedMemoryUnregister": small(
            "grpc_shm", pb.SystemSharedMemoryUnregisterRequest, shm_unregister
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE, methods)
