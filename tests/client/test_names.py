"""Names in the client's URLs, through the system's resolver (no mock: `localhost`, as this
host's /etc/hosts has it), against servers written by hand (tests/client/fake_server.py): the
addresses a name stands for become endpoints, the name stays the Host header, and an endpoint
that failed gets work again only after its `/health/ready` said 200. Three real replicas
behind one name: tests/client/test_names_served.py."""

from __future__ import annotations

import concurrent.futures
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import torch

import zen_mla
from service.problems import problem_bytes
from tests.batches import BATCH_SPECS, make_batch
from tests.client.clients import CLIENTS, calling
from tests.client.fake_server import FakeServer, Request, _Listener, prefill_answer, response
from tests.processes import wait_for
from zen_mla.client import PrefillClient
from zen_mla.client._names import Lookups, resolve


def _localhost() -> list[str]:
    try:
        return resolve("http://localhost:1")
    except OSError:
        return []


needs_localhost = pytest.mark.skipif(
    "127.0.0.1" not in _localhost(), reason="localhost does not resolve to 127.0.0.1 here"
)


class Replica:
    """A fake service: prefill answered (or 503 while `unavailable`), `/health/ready` 200 while
    `ready`; `events` lists (path, status) in the order answered."""

    def __init__(self) -> None:
        self.ready = self.unavailable = False
        self.events: list[tuple[str, int]] = []
        self.server = FakeServer(self.answer)

    def answer(self, request: Request, conn: socket.socket, stop: threading.Event) -> None:
        if request.path == "/health/ready":
            status = 200 if self.ready else 503
            conn.sendall(response(status, b'{"status": "-"}'))
        elif self.unavailable:
            status = 503
            conn.sendall(problem_bytes(zen_mla.ServiceUnavailableError("the service is starting")))
        else:
            status = 200
            conn.sendall(prefill_answer(request))
        self.events.append((request.path, status))

    def prefills(self) -> list[int]:
        return [status for path, status in self.events if path == "/prefill"]


@needs_localhost
@pytest.mark.parametrize("kind", CLIENTS)
def test_a_name_is_balanced_over_its_addresses_under_its_own_host_header(kind):
    q, k, v, cu, _ = make_batch(BATCH_SPECS["ragged"], (2, 64, 32), torch.bfloat16)
    want = zen_mla.ragged_attention(q, k, v, cu)
    with Replica().server as server:
        port = server.url.rsplit(":", 1)[1]
        url = f"http://localhost:{port}"
        with calling(kind, url, shared_memory=False, timeout=20) as (client, call):
            for _ in range(3):
                assert torch.equal(call(q, k, v, cu), want)
            addresses = [e.address for e in client._balancer.endpoints]
            assert "127.0.0.1" in addresses and len(addresses) == len(_localhost())
            assert all(e.source == url for e in client._balancer.endpoints)
        assert {r.headers["host"] for r in server.requests} == {f"localhost:{port}"}


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_failed_endpoint_gets_work_again_only_after_it_says_ready(kind):
    q, k, v, cu, _ = make_batch(BATCH_SPECS["single"], (1, 16, 16), torch.bfloat16)
    a, b = Replica(), Replica()
    a.unavailable = True
    with (
        a.server,
        b.server,
        calling(kind, [a.server.url, b.server.url], shared_memory=False) as (
            _,
            call,
        ),
    ):
        deadline = time.monotonic() + 1.5  # past a few probes (`PROBE_FIRST`, doubling)
        while time.monotonic() < deadline:
            call(q, k, v, cu)
            time.sleep(0.01)
        assert a.prefills() == [503]  # down after it, however often it was probed meanwhile
        assert ("/health/ready", 503) in a.events
        a.ready, a.unavailable = True, False

        def served() -> bool:
            call(q, k, v, cu)
            return 200 in a.prefills()

        wait_for(served, 10, "the endpoint got no work after it said ready", 0.01)
        first_work = a.events.index(("/prefill", 200))
        assert ("/health/ready", 200) in a.events[:first_work]


class TLSServer(FakeServer):
    """A FakeServer over TLS, with a certificate for `localhost` alone (no IP address in it);
    `names` lists the server names the clients' handshakes asked for (SNI)."""

    def __init__(self, tmp, answer: Callable[[Request, socket.socket, threading.Event], None]):
        cert, key = tmp / "cert.pem", tmp / "key.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True,
        )  # fmt: skip
        self.cert, self.names = cert, []
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        context.sni_callback = lambda sock, name, ctx: self.names.append(name)  # type: ignore[assignment]
        self._answer, self.requests = answer, []
        raw = socket.create_server(("127.0.0.1", 0))
        self.port = raw.getsockname()[1]
        _Listener.__init__(self, context.wrap_socket(raw, server_side=True))


@needs_localhost
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate")
def test_over_tls_an_address_is_reached_under_its_names_certificate(tmp_path):
    """The certificate names `localhost` only: connected to 127.0.0.1, the handshake passes
    only with the name as the server name, checked against the certificate."""
    q, k, v, cu, _ = make_batch(BATCH_SPECS["single"], (1, 16, 16), torch.bfloat16)
    with TLSServer(tmp_path, lambda r, conn, _: conn.sendall(prefill_answer(r))) as server:
        transport = httpx.HTTPTransport(verify=ssl.create_default_context(cafile=server.cert))
        url = f"https://localhost:{server.port}"
        with PrefillClient(url, transport=transport, shared_memory=False, timeout=20) as client:
            assert torch.equal(client.prefill(q, k, v, cu), zen_mla.ragged_attention(q, k, v, cu))
            assert any(e.address == "127.0.0.1" for e in client._balancer.endpoints)
        assert server.names and set(server.names) == {"localhost"}
        assert {r.headers["host"] for r in server.requests} == {f"localhost:{server.port}"}


def test_a_name_that_does_not_resolve_is_reached_by_name_as_before():
    with PrefillClient("http://zen-mla.invalid:1", retries=0, timeout=10) as client:
        q = torch.randn(4, 1, 8)
        with pytest.raises(zen_mla.ServiceUnavailableError, match="unreachable"):
            client.prefill(q, q, q, torch.tensor([0, 4]))
        assert [e.address for e in client._balancer.endpoints] == [None]


@needs_localhost
def test_names_are_looked_up_again_once_the_period_passed():
    lookups = Lookups(["http://127.0.0.1:1", "http://localhost:1"], every=0.3)
    assert lookups.urls == ["http://localhost:1"]
    first = lookups.due()
    assert first is not None and lookups.due() is first  # one lookup at a time
    concurrent.futures.wait([first], timeout=10)
    taken = lookups.take()
    assert taken is not None and taken[1] and "127.0.0.1" in (taken[0]["http://localhost:1"] or [])
    assert lookups.take() is None and lookups.due() is None  # not due yet
    time.sleep(0.3)
    again = lookups.due()
    assert again is not None
    concurrent.futures.wait([again], timeout=10)
    taken = lookups.take()
    assert taken is not None and not taken[1]
