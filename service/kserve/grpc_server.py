"""The Open Inference Protocol over gRPC: KServe v2's `inference.GRPCInferenceService`, served
by grpc.aio on the service's event loop, on its own port (`grpc_port`).

Every method reads its one message itself (each is registered as a stream of requests, so the
service sees the call before its message). `ModelInfer` and `SystemSharedMemoryRegister` go
through the one pipeline (`pipeline.serve`, by a `doors.GrpcDoor`: token, admission before the
message is read, shares, deadline, queue, metrics, log line) and write their one response
themselves, its bytes charged to the caller until the call ends (as an HTTP answer's); the
others read a small message within the head limits (`header_timeout_s`, `REGISTER_BYTES`) and
answer at once. Errors are the HTTP ones as gRPC statuses (`grpc_errors`). Methods not served
(streaming, model repository, CUDA shared memory, statistics, trace and log settings) answer
UNIMPLEMENTED.

grpc's transport enforces the limits a request's head has on HTTP: the message limit
(`max_body_bytes`, refused before it is read: RESOURCE_EXHAUSTED), metadata size, the time to
complete a connection's handshake, and open connections; a connection idle that long is closed,
and any after `CONNECTION_AGE_S` (clients reconnect by themselves)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2 as pb

from zen_mla import BodyTooLargeError, RequestTimeoutError, ZenMLAError, __version__

from ..doors import GrpcDoor, trusted_proxies
from ..forms.base import Form
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
    parse,
)
from .register import REGISTER_BYTES, registry_of

__all__ = ["SERVICE", "GrpcListenError", "grpc_options", "start_grpc"]

SERVICE = "inference.GRPCInferenceService"
#: a connection's life: then GOAWAY (clients reconnect, and re-resolve a name to its replicas),
#: and closed once its calls end or `deadline_s` later, whatever a caller leaves unread
CONNECTION_AGE_S = 300
M = TypeVar("M", bound=Message)
Context = Any  # grpc.aio.ServicerContext


class GrpcListenError(RuntimeError):
    """The gRPC port cannot be listened on (in use, or not this host's)."""


def grpc_options(settings: Settings) -> list[tuple[str, int]]:
    """The transport's limits, from the service's settings."""
    head_ms = int(settings.header_timeout_s * 1000)
    return [
        ("grpc.max_receive_message_length", message_limit(settings)),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_metadata_size", settings.max_header_bytes),
        ("grpc.absolute_max_metadata_size", settings.max_header_bytes),
        ("grpc.server_handshake_timeout_ms", head_ms),
        ("grpc.max_connection_idle_ms", head_ms),
        ("grpc.max_allowed_incoming_connections", settings.max_connections),
        ("grpc.max_connection_age_ms", CONNECTION_AGE_S * 1000),
        ("grpc.max_connection_age_grace_ms", int(settings.deadline_s * 1000)),
        ("grpc.so_reuseport", 0),  # a port in use is an error, not a second listener on it
    ]


async def start_grpc(state: ServiceState) -> grpc.aio.Server:
    """The gRPC server for `state`, listening (GrpcListenError where its port cannot be bound)."""
    s = state.settings
    server = grpc.aio.server(options=grpc_options(s))
    server.add_generic_rpc_handlers((_handlers(state),))
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
    """The answer written: an error's status, or the response, its bytes charged to its client
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


def _handlers(state: ServiceState) -> grpc.GenericRpcHandler:
    s = state.settings
    big_json = asyncio.Semaphore(1)  # as on HTTP: one large request head parsed at a time
    proxies = trusted_proxies(s.forwarded_allow_ips)

    async def small(context: Context, kind: type[M]) -> tuple[M, GrpcDoor]:
        """A method's small message, read within the head limits."""
        door = GrpcDoor(context, proxies)
        try:
            raw = await asyncio.wait_for(door.read(), s.header_timeout_s)
        except TimeoutError:
            raise RequestTimeoutError(
                f"the message did not arrive within {s.header_timeout_s} s"
            ) from None
        if len(raw) > REGISTER_BYTES:
            raise BodyTooLargeError(f"message: expected at most {REGISTER_BYTES} bytes")
        return parse(kind, raw), door

    def method(call: Callable[[Any, GrpcDoor], Awaitable[Message]], kind: type[M]) -> Any:
        async def handle(_: Any, context: Context) -> bytes | None:
            try:
                msg, door = await small(context, kind)
                answer: bytes = (await call(msg, door)).SerializeToString()
                return answer
            except ZenMLAError as exc:
                await _send(context, grpc_error(exc))
                return None
            except Exception:  # ClientDisconnect: the call ended before its message came
                if context.done() or context.cancelled():
                    return None
                raise

        return grpc.stream_unary_rpc_method_handler(handle)

    def ready() -> bool:
        return readiness(state).ready

    async def server_live(msg: Any, door: GrpcDoor) -> Message:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(msg: Any, door: GrpcDoor) -> Message:
        return pb.ServerReadyResponse(ready=ready())

    async def model_ready(msg: pb.ModelReadyRequest, door: GrpcDoor) -> Message:
        kr.check_model(msg.name, msg.version)
        return pb.ModelReadyResponse(ready=ready())

    async def server_metadata(msg: Any, door: GrpcDoor) -> Message:
        extensions = ["binary_tensor_data", "parameters"]
        if s.system_shm:
            extensions.append("system_shared_memory")
        return pb.ServerMetadataResponse(name="zen-mla", version=__version__, extensions=extensions)

    async def model_metadata(msg: pb.ModelMetadataRequest, door: GrpcDoor) -> Message:
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

    async def shm_status(msg: pb.SystemSharedMemoryStatusRequest, door: GrpcDoor) -> Message:
        door.authorize(state.tenants)
        response = pb.SystemSharedMemoryStatusResponse()
        for region in registry_of(state).status(msg.name or None):
            entry = response.regions[str(region["name"])]
            entry.name, entry.key = str(region["name"]), str(region["key"])
            entry.offset, entry.byte_size = int(region["offset"]), int(region["byte_size"])  # type: ignore[call-overload]
        return response

    async def shm_unregister(
        msg: pb.SystemSharedMemoryUnregisterRequest, door: GrpcDoor
    ) -> Message:
        door.authorize(state.tenants)
        registry_of(state).unregister(msg.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def through_pipeline(context: Context, form: Form[GrpcAnswer]) -> None:
        """`form`'s call through the one pipeline, in a task of its own: grpc cancels a
        handler whose caller goes, and the pipeline must see a hang-up (its work, still read
        by a worker, handed to the task that waits it out), never a cancelled request that
        gives its buffers back under a running worker."""
        door = GrpcDoor(context, proxies)
        task = asyncio.ensure_future(serve(state, door, form))
        try:
            answer = await asyncio.shield(task)
        except asyncio.CancelledError:
            door.hang_up()
            state.abandoned.add(task)
            task.add_done_callback(_discard_answer(state))
            raise
        await _send(context, answer)

    async def model_infer(_: Any, context: Context) -> None:
        await through_pipeline(context, GrpcInferForm(state.system_shm, big_json))

    async def shm_register(_: Any, context: Context) -> None:
        await through_pipeline(context, GrpcRegisterForm(state))

    methods = {
        "ServerLive": method(server_live, pb.ServerLiveRequest),
        "ServerReady": method(server_ready, pb.ServerReadyRequest),
        "ModelReady": method(model_ready, pb.ModelReadyRequest),
        "ServerMetadata": method(server_metadata, pb.ServerMetadataRequest),
        "ModelMetadata": method(model_metadata, pb.ModelMetadataRequest),
        "ModelInfer": grpc.stream_stream_rpc_method_handler(model_infer),
        "SystemSharedMemoryStatus": method(shm_status, pb.SystemSharedMemoryStatusRequest),
        "SystemSharedMemoryRegister": grpc.stream_stream_rpc_method_handler(shm_register),
        "SystemSharedMemoryUnregister": method(
            shm_unregister, pb.SystemSharedMemoryUnregisterRequest
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE, methods)
