"""What the vLLM link does with a 200 it cannot use: a loopback stand-in of the service whose
`/health` says ok and whose `/prefill` answers a well-formed safetensors body of the right shape
and dtype, holding NaN or inf. From finite inputs that is a failed call (computed here, counted
as an outage, the link down, as for an unreachable service); from non-finite inputs it is the
inputs' doing and an answer. Request by request: NaN in one request's inputs answers for NaN in
that request's outputs only (`context.check_finite`)."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

import zen_mla
from zen_mla import vllm, wire
from zen_mla.client import PrefillClient
from zen_mla.vllm import RemoteSettings
from zen_mla.vllm import context as vllm_context

T, H, D = 6, 4, 16
SCALE = 0.25
QUERY_START_LOC = torch.tensor([0, 3, 6], dtype=torch.int32)
NAN, INF = float("nan"), float("inf")


class _Meta:
    query_start_loc = QUERY_START_LOC


Answer = dict[str, torch.Tensor]


@pytest.fixture
def service_answers() -> Iterator[Callable[[Answer], RemoteSettings]]:
    """A loopback HTTP server: GET answers `{"status": "ok"}`, POST /prefill reads the request
    and answers 200 with the tensors it is given (whatever was asked). Gives settings for it
    whose prober waits a minute (the link stays down for the rest of a test)."""
    answer: list[Answer] = [{}]
    posts: list[int] = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, content_type: str, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send("application/json", json.dumps({"status": "ok"}).encode())

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            posts[0] += 1
            header, chunks = wire.encode(answer[0], {"kernel": "stand-in"})
            self._send("application/octet-stream", header + b"".join(bytes(c) for c in chunks))

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()

    def answering(tensors: Answer) -> RemoteSettings:
        answer[0] = tensors
        return RemoteSettings(
            urls=(f"http://127.0.0.1:{httpd.server_address[1]}",),
            probe_interval_s=60.0,
            probe_max_interval_s=60.0,
        )

    answering.posts = posts  # type: ignore[attr-defined]
    yield answering
    httpd.shutdown()
    httpd.server_close()


def backend(settings: RemoteSettings):
    b = vllm.backend_class()(H, SCALE, 16, 16, 0, D, None, settings=settings)
    b.prepare_metadata(_Meta())
    return b


def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = (torch.randn(T, H, D, dtype=torch.bfloat16) for _ in range(3))
    return q, k, v


def out_of(value: float) -> torch.Tensor:
    out = torch.randn(T, H, D, dtype=torch.bfloat16)
    out[2, 1, 3] = value
    return out


def lse_of(value: float) -> torch.Tensor:
    lse = torch.randn(H, T, dtype=torch.float32)
    lse[1, 4] = value
    return lse


UNUSABLE = {
    "nan_out": (out_of(NAN), lse_of(0.0)),
    "inf_out": (out_of(INF), lse_of(0.0)),
    "minus_inf_out": (out_of(-INF), lse_of(0.0)),
    "nan_lse": (out_of(0.0), lse_of(NAN)),
    "inf_lse": (out_of(0.0), lse_of(INF)),
}


@pytest.mark.parametrize("into", [False, True], ids=["new_out", "into_out"])
@pytest.mark.parametrize(("out", "lse"), UNUSABLE.values(), ids=UNUSABLE.keys())
def test_nan_or_inf_from_finite_inputs_is_a_failed_call(service_answers, out, lse, into, caplog):
    """Computed here (ragged_attention's numbers, written into `out` where given), counted local,
    one outage, one warning, the link down: as an unreachable service."""
    b = backend(service_answers({"out": out, "lse": lse}))
    q, k, v = qkv()
    into_out = torch.empty(T, H, D, dtype=torch.bfloat16) if into else None
    before = vllm.stats.snapshot()
    with caplog.at_level(logging.WARNING, logger="zen_mla.vllm"):
        got, got_lse = b.run_prefill_new_tokens(q, k, v, True, out=into_out)
    after = vllm.stats.snapshot()
    assert service_answers.posts[0] == 1  # the service was asked, and its answer not taken
    want, want_lse = zen_mla.ragged_attention(
        q, k, v, QUERY_START_LOC, return_lse=True, scale=SCALE
    )
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    assert into_out is None or got is into_out
    assert (after.local - before.local, after.remote - before.remote) == (1, 0)
    assert after.outages - before.outages == 1 and not b.link.up
    (warning,) = [r.getMessage() for r in caplog.records if "gave no answer" in r.getMessage()]
    assert "KernelError" in warning and "NaN or inf" in warning


def test_a_context_chunk_answered_with_nan_is_computed_here(service_answers):
    b = backend(service_answers({"out": out_of(NAN), "lse": lse_of(0.0)}))
    q, k, v = qkv()
    chunk = _Meta()
    chunk.cu_seq_lens = QUERY_START_LOC  # type: ignore[attr-defined]
    before = vllm.stats.snapshot()
    got, got_lse = b.run_prefill_context_chunk(chunk, q, k, v)
    want, want_lse = zen_mla.ragged_attention(
        q, k, v, QUERY_START_LOC, QUERY_START_LOC, causal=False, return_lse=True, scale=SCALE
    )
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    assert vllm.stats.snapshot().outages - before.outages == 1 and not b.link.up


def test_without_the_fallback_nan_from_finite_inputs_is_an_error(service_answers):
    settings = service_answers({"out": out_of(NAN)})
    b = backend(RemoteSettings(urls=settings.urls, fallback=False))
    with pytest.raises(zen_mla.KernelError, match=r"out with 1 of 384 values NaN or inf"):
        b.run_prefill_new_tokens(*qkv(), False)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_from_nan_inputs_is_an_answer(service_answers, where):
    """NaN in gives NaN out: no fault of the service's, no outage, the answer returned."""
    b = backend(service_answers({"out": out_of(NAN)}))
    q, k, v = qkv()
    {"q": q, "k": k, "v": v}[where][0, 0, 0] = NAN
    before = vllm.stats.snapshot()
    got = b.run_prefill_new_tokens(q, k, v, False)
    after = vllm.stats.snapshot()
    assert bool(got[2, 1, 3].isnan())
    assert (after.remote - before.remote, after.local - before.local) == (1, 0)
    assert after.outages == before.outages and b.link.up


def test_an_lse_of_minus_inf_is_an_answer(service_answers):
    """A query that sees no key: out 0, lse -inf (docs/protocol.md)."""
    out, lse = torch.zeros(T, H, D, dtype=torch.bfloat16), lse_of(-INF)
    b = backend(service_answers({"out": out, "lse": lse}))
    before = vllm.stats.snapshot()
    got, got_lse = b.run_prefill_new_tokens(*qkv(), True)
    assert torch.equal(got, out) and torch.equal(got_lse, lse)
    assert vllm.stats.snapshot().remote - before.remote == 1 and b.link.up


def test_a_client_of_its_own_gets_an_error_from_prefill_with_context(service_answers):
    """`prefill_with_context` with a `PrefillClient` (no link, no fallback) checks each piece."""
    settings = service_answers({"out": out_of(INF)})
    with (
        PrefillClient(settings.urls[0], retries=0) as client,
        pytest.raises(zen_mla.KernelError, match="NaN or inf"),
    ):
        vllm.prefill_with_context(client, *qkv(), QUERY_START_LOC, [], scale=SCALE)


@pytest.mark.parametrize(
    ("out", "lse", "query", "match"),
    [
        (out_of(NAN), None, 2, r"out with 1 of 384 values NaN or inf"),
        (out_of(0.0), lse_of(INF), 4, r"lse with 1 of 24 values NaN or inf"),
    ],
    ids=["out", "lse"],
)
def test_check_finite_names_the_output(out, lse, query, match):
    """The bad value is query `query`'s: inf in its request's keys is no fault of the
    service's; inf in the other request's is."""
    q, k, v = qkv()
    with pytest.raises(zen_mla.KernelError, match=match):
        vllm_context.check_finite(out, lse, q, k, v, QUERY_START_LOC)
    other = T - 1 - query  # in the other request (QUERY_START_LOC: [0, 3, 6])
    k[other, 0, 0] = INF
    with pytest.raises(zen_mla.KernelError, match=match):
        vllm_context.check_finite(out, lse, q, k, v, QUERY_START_LOC)
    k[query, 0, 0] = INF
    vllm_context.check_finite(out, lse, q, k, v, QUERY_START_LOC)


def test_check_finite_takes_large_finite_values_for_what_they_are():
    """fp16 values whose sum overflows (the check's first, cheap pass) and an lse of -inf (a
    query that sees no key) are answers."""
    q, k, v = qkv()
    out = torch.full((T, H, D), 60000.0, dtype=torch.float16)
    assert torch.isinf(out.sum())
    vllm_context.check_finite(out, torch.full((H, T), -INF), q, k, v, QUERY_START_LOC)


# -- request by request --------------------------------------------------------------------------

#: a step of four requests (new tokens 3, 0, 5, 4) against keys of 2, 4, 0, 6 (a context chunk)
Q_CU = torch.tensor([0, 3, 3, 8, 12], dtype=torch.int32)
KV_CU = torch.tensor([0, 2, 6, 6, 12], dtype=torch.int32)


def _step() -> tuple[torch.Tensor, ...]:
    q = torch.randn(12, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(12, H, D, dtype=torch.bfloat16) for _ in range(2))
    out = torch.randn(12, H, D, dtype=torch.bfloat16)
    return q, k, v, out, torch.randn(H, 12)


#: (input, its row, output, its row or column): NaN in the first, the second not finite
ACROSS_REQUESTS = {
    "q of request 0, out of request 2": ("q", 1, "out", 5),
    "k of request 1, out of request 0": ("k", 3, "out", 0),
    "v of request 3, out of request 2": ("v", 7, "out", 7),
    "q of request 3, lse of request 0": ("q", 9, "lse", 2),
    "k of request 0, lse of request 3": ("k", 0, "lse", 11),
}


@pytest.mark.parametrize("case", ACROSS_REQUESTS)
def test_nan_in_one_request_lets_no_nan_through_in_another(case):
    """NaN in one request's inputs answers for NaN in that request's outputs only."""
    given, given_row, sent, sent_row = ACROSS_REQUESTS[case]
    q, k, v, out, lse = _step()
    {"q": q, "k": k, "v": v}[given][given_row, 1, 2] = NAN
    if sent == "out":
        out[sent_row, 0, 0] = NAN
    else:
        lse[3, sent_row] = NAN
    with pytest.raises(zen_mla.KernelError, match=rf"{sent} with 1 of \d+ values NaN"):
        vllm_context.check_finite(out, lse, q, k, v, Q_CU, KV_CU)


#: (input, its row, output row): the output's request is the input's (through KV_CU for k, v)
WITHIN_A_REQUEST = {
    "q and out of request 0": ("q", 1, 2),
    "k and out of request 3": ("k", 11, 8),
    "v and out of request 2": ("v", 0, 1),
}


@pytest.mark.parametrize("case", WITHIN_A_REQUEST)
def test_nan_in_a_requests_inputs_answers_for_its_own_outputs(case):
    given, given_row, out_row = WITHIN_A_REQUEST[case]
    q, k, v, out, lse = _step()
    {"q": q, "k": k, "v": v}[given][given_row, 1, 2] = NAN
    out[out_row] = NAN
    lse[:, out_row] = NAN
    vllm_context.check_finite(out, lse, q, k, v, Q_CU, KV_CU)


def test_a_request_with_nan_inputs_hides_no_bad_output_of_another():
    """Request 0 fed NaN and answered NaN, request 3 fed finite numbers and answered inf: the
    error names request 3 and counts its values only."""
    q, k, v, out, lse = _step()
    q[0] = NAN
    out[0:3] = NAN
    out[9, :, 1] = INF
    with pytest.raises(zen_mla.KernelError, match=r"out with 4 of 768 values .* request 3 of 4"):
        vllm_context.check_finite(out, lse, q, k, v, Q_CU, KV_CU)


def test_the_link_computes_here_a_request_answered_nan_beside_one_fed_nan(service_answers):
    """Through the backend: request 0's q holds NaN and the service answers NaN in request 1's
    out: computed here (an outage), where before the NaN in request 0 let it through."""
    out = torch.randn(T, H, D, dtype=torch.bfloat16)
    out[4, 0, 0] = NAN  # request 1 (QUERY_START_LOC: [0, 3, 6])
    b = backend(service_answers({"out": out}))
    q, k, v = qkv()
    q[0, 0, 0] = NAN
    before = vllm.stats.snapshot()
    got = b.run_prefill_new_tokens(q, k, v, False)
    after = vllm.stats.snapshot()
    want = zen_mla.ragged_attention(q, k, v, QUERY_START_LOC, scale=SCALE)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert bool(got[3:].isfinite().all())  # request 1 computed here: no NaN
    assert (after.local - before.local, after.remote - before.remote) == (1, 0)
    assert after.outages - before.outages == 1 and not b.link.up
