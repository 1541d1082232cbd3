"""The gRPC door's limits. On real servers, each attack beside a legitimate caller answered
right: large messages to every kind of method (with and without a token), many large
`ModelInfer` messages from one tenant, thousands of streams, HTTP/2 rapid reset, and a
connection flood against a process with few descriptors. Memory is measured as the server's peak
resident set (`VmHWM`, reset before each attack) against the bytes `/health` says are charged
(`held_bytes`, sampled meanwhile); each test prints what it measured. In the fast tier: the
rapid-reset rule, a connection closed by its two ends, and the one connection budget."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import pytest
import torch
from tritonclient.grpc import InferenceServerClient, InferenceServerException
from tritonclient.grpc import service_pb2 as pb

from bench._server import free_port
from service.admission import Admission
from service.kserve import grpc_limits
from service.kserve.grpc_limits import CallLimits, close_connection
from service.server import connection_caps
from service.settings import Settings
from tests.batches import BatchSpec, make_batch
from tests.processes import eventually, open_fds
from tests.service.grpc_caller import grpc_inputs
from tests.service.servers import Server, serve, server_fixture
from tests.service.v2_tensors import to_torch
from zen_mla import QueueFullError, ragged_attention
from zen_mla.caller import Caller

MIB = 1 << 20
SERVICE = "/inference.GRPCInferenceService/"
ATTACKER = [("authorization", "Bearer 4ttack-token")]
LEGIT = {"authorization": "Bearer leg1t-token"}
BUDGET = 64 * MIB
#: below the server's gRPC message limit (a third of its budget: every call that reads a message
#: is charged three times that limit first, grpc holding a message in three copies as it reads)
MESSAGE = 16 * MIB
#: what the server's peak may pass the bytes it charged by: the legitimate caller's own and the
#: allocator's slack, not a message's
MARGIN = 8 * MIB
#: the words of a refusal before the message was read (the caller's share or the budget)
UNREAD = ("would pass the", "request bodies are being read", "gRPC calls are open")


@server_fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("grpc_limits")
    tenants = tmp / "tenants"
    tenants.write_text("attacker 4ttack-token\nlegit leg1t-token\n")
    with serve(
        tmp,
        grpc_port=free_port(),
        workers=1,
        deadline_s=4,
        header_timeout_s=2,
        body_grace_s=0.5,
        max_uploads=4,
        max_body_bytes=32 * MIB,
        max_inflight_bytes=BUDGET,
        tenants_file=tenants,
    ) as s:
        yield s


def _served(server: Server) -> float:
    """One legitimate call's seconds, its answer checked against the library's."""
    q, k, v, q_cu, _ = make_batch(BatchSpec([64, 32]), (2, 192, 128), torch.bfloat16)
    with InferenceServerClient(server.grpc_target) as c:
        t = time.monotonic()
        result = c.infer(
            "mla_prefill",
            grpc_inputs({"q": q, "k": k, "v": v, "q_cu_seq_lens": q_cu}),
            headers=LEGIT,
        )
        took = time.monotonic() - t
    assert torch.equal(to_torch(result.as_numpy("out")), ragged_attention(q, k, v, q_cu))
    return took


def _served_within(server: Server, seconds: float) -> float:
    """One legitimate call's seconds, tried again while the server refuses connections."""
    end = time.monotonic() + seconds
    while True:
        try:
            return _served(server)
        except InferenceServerException:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} for {pid}")


class Watch:
    """While an attack runs: the server's peak resident memory over its memory before (its
    high-water mark reset first), the most `/health` charged, and legitimate calls one after
    another, each answered right (`failed`: those that were not)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.pid = server.process.pid
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM back to VmRSS
        self.before = _status(self.pid, "VmRSS")
        self.charged = 0
        self.legit: list[float] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._health),
            threading.Thread(target=self._calls),
        ]
        for t in self._threads:
            t.start()

    def _health(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=10) as c:
            while not self._stop.is_set():
                held = c.get("/health").json()["held_bytes"]
                self.charged = max(self.charged, sum(held.values()))
                time.sleep(0.005)

    def _calls(self) -> None:
        while not self._stop.is_set():
            try:
                self.legit.append(_served(self.server))
            except Exception as exc:
                self.failed.append(repr(exc))
            time.sleep(0.05)

    def stop(self) -> None:
        """The attack is over: the peak read, and the memory after once the charges are back
        (within two messages of where it started, or 5 s)."""
        self._stop.set()
        for t in self._threads:
            t.join(30)
        self.peak = _status(self.pid, "VmHWM") - self.before
        assert eventually(lambda: sum(self.server.health()["held_bytes"].values()) == 0, 10)
        eventually(lambda: self.grown() <= 2 * MESSAGE, 5, 0.1)
        self.after = self.grown()

    def grown(self) -> int:
        return _status(self.pid, "VmRSS") - self.before

    def check(self, what: str) -> None:
        """Print the figures; the peak within what was charged (and MARGIN), back down after,
        every legitimate call answered right."""
        print(
            f"{what}: RSS +{self.peak / MIB:.0f} MiB at its peak, +{self.after / MIB:.0f} MiB "
            f"after; charged at most {self.charged / MIB:.0f} MiB; legit {len(self.legit)} "
            f"calls right, median {statistics.median(self.legit) * 1e3:.0f} ms, slowest "
            f"{max(self.legit) * 1e3:.0f} ms, {len(self.failed)} failed"
        )
        assert not self.failed, self.failed
        assert self.legit
        assert self.peak <= self.charged + MARGIN
        assert self.after <= 2 * MESSAGE


def _calls_at_once(
    server: Server, method: str, payload: bytes, n: int, metadata=()
) -> Counter[str]:
    """`n` calls of `method` at once, each sending `payload` (a serialized request): their
    status codes, a RESOURCE_EXHAUSTED told apart as refused `unread` or `read`."""
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(server.grpc_target, options=options) as channel:
        call = channel.unary_unary(SERVICE + method)
        futures = [call.future(payload, metadata=metadata, timeout=30) for _ in range(n)]
        codes: Counter[str] = Counter()
        for f in futures:
            code = f.code().name
            if code == "RESOURCE_EXHAUSTED":
                details = f.details() or ""
                code += " unread" if any(w in details for w in UNREAD) else " read"
            codes[code] += 1
    return codes


def _large(kind: type, **fields) -> bytes:
    """A request message of `kind` grown to MESSAGE bytes by a field it does not know."""
    head = kind(**fields).SerializeToString()
    pad = MESSAGE - len(head) - 6
    return head + b"\xfa\x3e" + _varint(pad) + b"\0" * pad  # field 999, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def test_large_messages_to_small_methods_are_never_read_uncharged(server):
    """Six 16 MiB messages at once, twice, to each method that carries no tensor: those whose
    request has no field answer without reading it; the others refuse a caller without a token
    unread, and read a tenant's only with the whole message limit charged to it first."""
    live = _large(pb.ServerLiveRequest)
    ready = _large(pb.ModelReadyRequest, name="mla_prefill")
    watch = Watch(server)
    try:
        codes = {
            "ServerLive": _calls_at_once(server, "ServerLive", live, 6)
            + _calls_at_once(server, "ServerLive", live, 6),
            "ServerMetadata": _calls_at_once(server, "ServerMetadata", live, 6),
            "ModelReady, no token": _calls_at_once(server, "ModelReady", ready, 6)
            + _calls_at_once(server, "ModelMetadata", ready, 6),
            "ModelReady, a tenant": _calls_at_once(server, "ModelReady", ready, 6, ATTACKER)
            + _calls_at_once(server, "ModelReady", ready, 6, ATTACKER),
        }
    finally:
        watch.stop()
    print({k: dict(v) for k, v in codes.items()})
    watch.check("16 MiB messages to small methods")
    assert codes["ServerLive"] == {"OK": 12} and codes["ServerMetadata"] == {"OK": 6}
    assert codes["ModelReady, no token"] == {"UNAUTHENTICATED": 12}
    # a tenant's: its share of the budget holds two messages' limits at once, the others are
    # refused unread meanwhile; those read are refused for their size (64 KiB at most)
    tenant = codes["ModelReady, a tenant"]
    assert tenant["RESOURCE_EXHAUSTED unread"] and tenant.total() == 12, tenant
    assert set(tenant) == {"RESOURCE_EXHAUSTED unread", "RESOURCE_EXHAUSTED read"}


def test_many_large_infer_messages_from_one_tenant_hold_no_more_than_they_are_charged(server):
    """Six 16 MiB ModelInfer messages at once, three times, from one tenant: each is charged the
    message limit before grpc reads it; those past the tenant's share are refused unread."""
    pad = b"\0" * MESSAGE
    infer = pb.ModelInferRequest(model_name="mla_prefill", raw_input_contents=[pad])
    payload = infer.SerializeToString()
    watch = Watch(server)
    try:
        codes = sum(
            (_calls_at_once(server, "ModelInfer", payload, 6, ATTACKER) for _ in range(3)),
            Counter(),
        )
    finally:
        watch.stop()
    print(dict(codes))
    watch.check("6 x 16 MiB ModelInfer from one tenant")
    # read: a raw entry no input names; unread: past the tenant's share of the budget
    assert codes["RESOURCE_EXHAUSTED unread"] and codes["INVALID_ARGUMENT"], codes
    assert set(codes) == {"RESOURCE_EXHAUSTED unread", "INVALID_ARGUMENT"}, codes


def _h2(server: Server) -> tuple[socket.socket, h2.connection.H2Connection]:
    sock = socket.create_connection(("127.0.0.1", server.grpc_port or 0), timeout=30)
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    return sock, conn


def _head(server: Server, method: str) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", SERVICE + method),
        (":authority", server.grpc_target),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


def _pump(
    sock: socket.socket, conn: h2.connection.H2Connection, on: Callable[[object], None]
) -> bool:
    """Reads what the server sent so far, handing each event to `on`; False once the server
    closed the connection (or sent GOAWAY)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                return False
            for event in conn.receive_data(data):
                on(event)
                if isinstance(event, h2.events.ConnectionTerminated):
                    return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def _reset_until_closed(server: Server, until: float) -> int:
    """HEADERS then RST_STREAM on one connection, as fast as it takes them, until the server
    closes it (or `until`): the streams sent, -1 where it was still open."""
    sock, conn = _h2(server)
    sent = 0
    try:
        while time.monotonic() < until:
            for _ in range(50):
                sid = conn.get_next_available_stream_id()
                conn.send_headers(sid, _head(server, "ServerLive"))
                conn.reset_stream(sid)
            sent += 50
            try:
                sock.sendall(conn.data_to_send())
            except OSError:
                return sent
            if not _pump(sock, conn, lambda event: None):
                return sent
        return -1
    finally:
        sock.close()


def test_connections_resetting_their_streams_are_closed(server):
    """HTTP/2 rapid reset for 3 s, a new connection each time one is closed: each is closed
    once it passes its resets, and another tenant's calls are answered right meanwhile."""
    watch = Watch(server)
    until = time.monotonic() + 3
    streams: list[int] = []
    try:
        while time.monotonic() < until:
            streams.append(_reset_until_closed(server, until))
    finally:
        watch.stop()
    print(f"rapid reset: {len(streams)} connections, closed after {sorted(streams)} streams")
    watch.check("rapid reset")
    closed = [n for n in streams if n >= 0]
    assert len(closed) >= len(streams) - 1 and max(closed) <= 5000, streams


def _unlimited(conn: h2.connection.H2Connection) -> None:
    """h2 keeps to the server's MAX_CONCURRENT_STREAMS; an attacker does not."""
    conn.remote_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = 1 << 30
    conn.remote_settings.acknowledge()


def test_thousands_of_streams_hold_only_their_share(server):
    """20,000 streams on 4 connections, as fast as the server takes them, none sending its
    message: ServerLive ones are answered at once, a tenant's ModelReady ones hold an upload
    slot each up to its share and are refused past it; streams past 100 on a connection are
    refused by grpc itself."""
    watch = Watch(server)
    ended: Counter[str] = Counter()
    lock = threading.Lock()

    def flood(method: str, headers: list[tuple[str, str]]) -> None:
        sock, conn = _h2(server)

        def on(event: object) -> None:
            if isinstance(event, h2.events.StreamReset):
                kind = f"reset {event.error_code!r}"
            elif isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                status = dict(event.headers).get("grpc-status")
                if status is None:
                    return
                kind = f"grpc-status {status}"
            else:
                return
            with lock:
                ended[kind] += 1

        try:
            for _ in range(5000):
                sid = conn.get_next_available_stream_id()
                conn.send_headers(sid, _head(server, method) + headers)
                sock.sendall(conn.data_to_send())
                _pump(sock, conn, on)
                _unlimited(conn)
            time.sleep(1)
            _pump(sock, conn, on)
        finally:
            sock.close()

    try:
        with ThreadPoolExecutor(4) as pool:
            list(
                pool.map(
                    lambda a: flood(*a), [("ServerLive", [])] * 2 + [("ModelReady", ATTACKER)] * 2
                )
            )
    finally:
        watch.stop()
    print(dict(ended))
    watch.check("20,000 streams on 4 connections")
    assert ended["reset <ErrorCodes.REFUSED_STREAM: 7>"] and ended["grpc-status 0"]
    assert ended["grpc-status 8"]  # a tenant's calls past its share: RESOURCE_EXHAUSTED


@server_fixture()
def few_descriptors(tmp_path: Path) -> Iterator[Server]:
    with serve(
        tmp_path, grpc_port=free_port(), workers=1, header_timeout_s=2, nofile=(512, 512)
    ) as s:
        yield s


def test_a_connection_flood_leaves_http_its_descriptors(few_descriptors):
    """600 gRPC connections against a process allowed 512 descriptors: gRPC holds its part of
    the one connection budget (half of 512 less the 256 kept), no more; HTTP, /health and, once
    the flood's idle connections are closed, gRPC answer."""
    server = few_descriptors
    preface = h2.connection.H2Connection()
    preface.initiate_connection()
    hello = preface.data_to_send()
    flood = []
    try:
        for _ in range(600):
            sock = socket.create_connection(("127.0.0.1", server.grpc_port or 0), timeout=10)
            sock.sendall(hello)
            flood.append(sock)
        fds = open_fds(server.process.pid)
        with server.client() as c:
            t = time.monotonic()
            health = [c.get("/health").status_code for _ in range(6)]
            took = time.monotonic() - t
        answered = time.monotonic()
        took_grpc = _served_within(server, 10)
        waited = time.monotonic() - answered
    finally:
        for sock in flood:
            sock.close()
    print(
        f"600 gRPC connections: server holds {fds} descriptors of 512; /health {health} in "
        f"{took * 1e3:.0f} ms; gRPC answered {waited:.2f} s later ({took_grpc * 1e3:.0f} ms)"
    )
    assert fds < 512 and health == [200] * 6
    assert "Too many open files" not in server.logs()


# -- the rules, in this process -----------------------------------------------------------------


FIRST = Caller.of("10.0.0.1")


class FakeDoor:
    def __init__(self, peer: str, caller: Caller = FIRST) -> None:
        self.peer = peer
        self.caller = caller


def _cancelled(limits: CallLimits, door: FakeDoor) -> None:
    with pytest.raises(asyncio.CancelledError), limits.held(door):
        raise asyncio.CancelledError


def test_a_connection_is_closed_past_its_resets_once_they_are_over_half_its_calls(monkeypatch):
    closed: list[str] = []
    monkeypatch.setattr(grpc_limits, "close_connection", lambda peer, port: closed.append(peer))
    settings = Settings(grpc_max_resets=10)
    limits = CallLimits(Admission(settings), settings, connections=4)
    busy, quick = FakeDoor("ipv4:10.0.0.1:5000"), FakeDoor("ipv4:10.0.0.1:5001")
    for _ in range(30):  # answered calls: a connection that works
        with limits.held(busy):
            pass
    for _ in range(10):
        _cancelled(limits, busy)
    for _ in range(9):
        _cancelled(limits, quick)
    assert closed == []  # 10 of 40 calls; 9 of 9, under the bound
    _cancelled(limits, quick)
    assert closed == ["ipv4:10.0.0.1:5001"]
    _cancelled(limits, quick)
    assert closed == ["ipv4:10.0.0.1:5001"]  # once


def test_a_client_past_its_share_of_calls_is_refused_before_its_call_runs():
    settings = Settings(grpc_max_calls=4)
    admission = Admission(settings)
    limits = CallLimits(admission, settings, connections=4)
    door = FakeDoor("ipv4:10.0.0.1:5000")
    with contextlib.ExitStack() as held:
        for _ in range(4):
            held.enter_context(limits.held(door))
        other = FakeDoor("ipv4:10.0.0.2:5000", Caller.of("10.0.0.2"))
        held.enter_context(limits.held(other))
        with pytest.raises(QueueFullError, match="gRPC calls are open"):
            held.enter_context(limits.held(door))
    assert admission.calls.total == 0


def test_a_connection_is_closed_by_its_two_ends():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as caller:
            accepted, _ = listener.accept()
            with accepted:
                here = caller.getsockname()[1]
                assert not close_connection(f"ipv4:127.0.0.1:{here + 1}", port)
                assert close_connection(f"ipv4:127.0.0.1:{here}", port)
                caller.settimeout(5)
                assert caller.recv(1) == b""  # the far end's FIN
                assert accepted.fileno() >= 0  # the descriptor is still its owner's


@pytest.mark.parametrize(
    ("settings", "fd_limit", "http", "grpc"),
    [
        ({}, 1 << 20, 768, 256),
        ({}, 512, 128, 128),
        ({"grpc_port": 0}, 512, 256, 0),
        ({"max_connections": 100}, 1 << 20, 50, 50),
        ({"grpc_max_connections": 8}, 1 << 20, 1016, 8),
    ],
)
def test_http_and_grpc_share_one_connection_budget(settings, fd_limit, http, grpc):
    caps = connection_caps(Settings(**settings), fd_limit)
    assert (caps.http, caps.grpc) == (http, grpc)
