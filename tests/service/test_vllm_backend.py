"""The vLLM backend through a real server: vLLM's own CPU MLA backend cases, MLA head dims, and
the property the LSE exists for: new tokens (causal) merged with every context chunk
(non-causal) equal bottom-right causal attention over context + new tokens."""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import zen_mla
from tests.prefill_steps import STEP_SPECS, make_step
from tests.processes import wait_for
from tests.reference import assert_close_to_reference, attention_fp64
from tests.service.restart import kill, requests_answered, serve_on
from tests.service.servers import free_port, serve
from zen_mla import vllm
from zen_mla.attention.merge import merge_attn_states
from zen_mla.client import PrefillClient
from zen_mla.vllm import (
    ContextKV,
    RemoteSettings,
    backend_class,
    prefill_with_context,
    service_ready,
)

MLA = (4, 192, 128)


def make_backend(url: str | tuple[str, ...], heads=(4, 16, 16), scale=0.25, token=None):
    h, dqk, dv = heads
    urls = (url,) if isinstance(url, str) else url
    settings = RemoteSettings(urls=urls, token=token)
    return backend_class()(h, scale, 512, dqk, 0, dv, None, settings=settings)


class Meta:
    def __init__(self, query_start_loc):
        self.query_start_loc = query_start_loc


class Chunk:
    def __init__(self, query_start_loc, cu_seq_lens):
        self.query_start_loc, self.cu_seq_lens = query_start_loc, cu_seq_lens


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def close_to_fp64(got, want, atol=2e-2):
    return torch.allclose(got.double(), want, atol=atol)


# vLLM's tests/v1/attention CPU MLA prefill cases: H=4, D=16, scale 0.25, bf16, atol 2e-2.


def test_vllm_cpu_case_new_tokens(server):
    b = make_backend(server.url)
    b.prepare_metadata(Meta(i32(0, 3, 6)))
    q, k, v = (torch.randn(6, 4, 16, dtype=torch.bfloat16) for _ in range(3))
    ref_out, ref_lse = attention_fp64(q, k, v, [0, 3, 6], [0, 3, 6], causal=True, scale=0.25)

    out = b.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
    assert out.shape == (6, 4, 16) and out.dtype == torch.bfloat16
    assert close_to_fp64(out, ref_out)

    out, lse = b.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    assert close_to_fp64(out, ref_out) and close_to_fp64(lse, ref_lse)
    assert lse.shape == (4, 6) and lse.dtype == torch.float32


def test_vllm_cpu_case_context_chunk(server):
    b = make_backend(server.url)
    b.prepare_metadata(Meta(i32(0, 5)))
    chunk = Chunk(i32(0, 2, 5), i32(0, 3, 7))
    q = torch.randn(5, 4, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(7, 4, 16, dtype=torch.bfloat16) for _ in range(2))
    ref_out, ref_lse = attention_fp64(q, k, v, [0, 2, 5], [0, 3, 7], causal=False, scale=0.25)

    out, lse = b.run_prefill_context_chunk(chunk, q, k, v)
    assert out.shape == (5, 4, 16) and lse.shape == (4, 5)
    assert close_to_fp64(out, ref_out) and close_to_fp64(lse, ref_lse)


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
def test_mla_dims_new_tokens(server, return_lse):
    q_cu = i32(0, 37, 37, 101)
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(101, 4, 192, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(101, 4, 128, generator=gen).bfloat16()
    b = make_backend(server.url, MLA, scale=192**-0.5)
    b.prepare_metadata(Meta(q_cu))
    got = b.run_prefill_new_tokens(q, k, v, return_lse)
    out, lse = got if return_lse else (got, None)
    assert_close_to_reference(q, k, v, q_cu, None, True, out, lse)


def test_mla_dims_context_chunk(server):
    q_cu, kv_cu = i32(0, 8, 28, 28), i32(0, 50, 50, 59)  # request 1 sees no keys
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(28, 4, 192, generator=gen).bfloat16()
    k = torch.randn(59, 4, 192, generator=gen).bfloat16()
    v = torch.randn(59, 4, 128, generator=gen).bfloat16()
    b = make_backend(server.url, MLA, scale=0.1)
    b.prepare_metadata(Meta(q_cu))
    out, lse = b.run_prefill_context_chunk(Chunk(q_cu, kv_cu), q, k, v)
    assert_close_to_reference(q, k, v, q_cu, kv_cu, False, out, lse, scale=0.1)
    assert torch.equal(out[8:28], torch.zeros_like(out[8:28])) and torch.isneginf(lse[:, 8:]).all()


def test_views_as_vllm_makes_them(server):
    """vLLM's k and v are views: v is the second half of an up-projected kv_nope, strided."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(20, 4, 192, generator=gen).bfloat16()
    kv_nope = torch.randn(20, 4, 128 + 128, generator=gen).bfloat16()
    k_nope, v = kv_nope.split([128, 128], dim=-1)
    k_pe = torch.randn(20, 1, 64, generator=gen).bfloat16()
    k = torch.cat((k_nope, k_pe.expand(-1, 4, -1)), dim=-1)
    assert not v.is_contiguous()
    b = make_backend(server.url, MLA, scale=0.1)
    b.prepare_metadata(Meta(i32(0, 12, 20)))
    out, lse = b.run_prefill_new_tokens(q, k, v, True)
    assert_close_to_reference(q, k, v, i32(0, 12, 20), None, True, out, lse, scale=0.1)


def test_out_is_written_in_place(server):
    b = make_backend(server.url)
    b.prepare_metadata(Meta(i32(0, 3, 6)))
    q, k, v = (torch.randn(6, 4, 16, dtype=torch.bfloat16) for _ in range(3))
    want = b.run_prefill_new_tokens(q, k, v, False)
    out = torch.full((6, 4, 16), float("nan"), dtype=torch.bfloat16)
    assert b.run_prefill_new_tokens(q, k, v, False, out=out) is out
    assert torch.equal(out, want)
    out.fill_(float("nan"))
    got, _lse = b.run_prefill_new_tokens(q, k, v, True, out=out)
    assert got is out and torch.equal(out, want)
    chunk_out = torch.full((6, 4, 16), float("nan"), dtype=torch.bfloat16)
    got, _lse = b.run_prefill_context_chunk(Chunk(i32(0, 3, 6), i32(0, 6, 6)), q, k, v, chunk_out)
    assert got is chunk_out and not chunk_out.isnan().any()


def test_the_service_message_arrives_as_the_exception(server):
    b = make_backend(server.url)
    b.prepare_metadata(Meta(i32(0, 3, 6)))
    q, v = (torch.randn(6, 4, 16, dtype=torch.bfloat16) for _ in range(2))
    k = torch.randn(6, 2, 16, dtype=torch.bfloat16)  # 2 heads against q's 4
    with pytest.raises(zen_mla.InvalidInputError, match=r"^k: expected") as info:
        b.run_prefill_new_tokens(q, k, v, True)
    assert "4" in str(info.value)


# The property: parts merged by LSE are the whole, through the server.


def vllm_flow(b, step):
    """What vLLM's MLA prefill does with a backend: new tokens with LSE, the context chunks one
    after another folded by merge_attn_states, then context merged with new tokens."""
    b.prepare_metadata(Meta(step.query_start_loc))
    if not step.context:
        return b.run_prefill_new_tokens(step.q, step.k, step.v, True)
    new_out, new_lse = b.run_prefill_new_tokens(step.q, step.k, step.v, True)
    ctx_out = ctx_lse = None
    for c in step.context:
        out, lse = b.run_prefill_context_chunk(
            Chunk(step.query_start_loc, c.cu_seq_lens), step.q, c.k, c.v
        )
        if ctx_out is None:
            ctx_out, ctx_lse = out, lse
        else:
            merged, merged_lse = torch.empty_like(out), torch.empty_like(lse)
            merge_attn_states(merged, ctx_out, ctx_lse, out, lse, merged_lse)
            ctx_out, ctx_lse = merged, merged_lse
    result, result_lse = torch.empty_like(new_out), torch.empty_like(new_lse)
    merge_attn_states(result, ctx_out, ctx_lse, new_out, new_lse, result_lse)
    return result, result_lse


@pytest.mark.parametrize("how", ["vllm_flow", "helper"])
@pytest.mark.parametrize("spec", STEP_SPECS.values(), ids=STEP_SPECS.keys())
def test_new_tokens_merged_with_context_chunks_equal_full_causal_attention(server, spec, how):
    step = make_step(spec, MLA, torch.bfloat16)
    b = make_backend(server.url, MLA, scale=0.2)
    if how == "vllm_flow":
        out, lse = vllm_flow(b, step)
    else:
        b.prepare_metadata(Meta(step.query_start_loc))
        out, lse = b.run_prefill_with_context(step.q, step.k, step.v, step.context, True)
    assert_close_to_reference(
        step.q, step.full_k, step.full_v, step.query_start_loc, step.full_cu, True, out, lse, 0.2
    )


def test_the_helper_fills_out_and_returns_it(server):
    step = make_step(STEP_SPECS["two_chunks"], MLA, torch.bfloat16)
    out = torch.full((step.q.shape[0], 4, 128), float("nan"), dtype=torch.bfloat16)
    with PrefillClient(server.url) as client:
        got = prefill_with_context(
            client, step.q, step.k, step.v, step.query_start_loc, step.context, out=out
        )
        want = prefill_with_context(
            client, step.q, step.k, step.v, step.query_start_loc, step.context
        )
    assert got is out and torch.equal(out, want)


class _Rendezvous(ThreadPoolExecutor):
    """Runs each call only once `parties` calls have started: a step whose pieces were sent
    one after another would never get there (and time out)."""

    def __init__(self, parties: int) -> None:
        super().__init__(parties)
        self.barrier = threading.Barrier(parties, timeout=30)

    def submit(self, fn, /, *args, **kwargs):
        def met(*a, **kw):
            self.barrier.wait()
            return fn(*a, **kw)

        return super().submit(met, *args, **kwargs)


def test_the_helper_sends_every_piece_at_once(server):
    step = make_step(STEP_SPECS["many_chunks"], MLA, torch.bfloat16)
    pieces = 1 + len(step.context)
    with PrefillClient(server.url) as client, _Rendezvous(pieces) as pool:
        out, lse = prefill_with_context(
            client, step.q, step.k, step.v, step.query_start_loc, step.context,
            return_lse=True, executor=pool,
        )  # fmt: skip
    assert_close_to_reference(
        step.q, step.full_k, step.full_v, step.query_start_loc, step.full_cu, True, out, lse
    )


def test_several_endpoints_one_of_them_down(server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    step = make_step(STEP_SPECS["many_chunks"], MLA, torch.bfloat16)
    b = make_backend((dead, server.url, server.url), MLA, scale=0.25)
    b.prepare_metadata(Meta(step.query_start_loc))
    out, lse = b.run_prefill_with_context(step.q, step.k, step.v, step.context, True)
    assert_close_to_reference(
        step.q, step.full_k, step.full_v, step.query_start_loc, step.full_cu, True, out, lse, 0.25
    )


def test_a_failing_piece_fails_the_step(server):
    step = make_step(STEP_SPECS["two_chunks"], MLA, torch.bfloat16)
    keys = step.context[1]
    bad = ContextKV(keys.k, keys.v, i32(0, 2, 99))  # offsets past the chunk's keys
    b = make_backend(server.url, MLA)
    b.prepare_metadata(Meta(step.query_start_loc))
    with pytest.raises(zen_mla.InvalidInputError, match="kv_cu_seq_lens"):
        b.run_prefill_with_context(step.q, step.k, step.v, [step.context[0], bad])


def test_is_available_against_a_ready_server(server):
    service_ready.cache_clear()
    try:
        assert service_ready(RemoteSettings(urls=(server.url,)))
    finally:
        service_ready.cache_clear()


@pytest.mark.slow
def test_the_token_is_sent(tmp_path):
    with serve(tmp_path, workers=1, api_token="s3cret") as guarded:
        q, k, v = (torch.randn(6, 4, 16, dtype=torch.bfloat16) for _ in range(3))
        good = make_backend(guarded.url, token="s3cret")
        good.prepare_metadata(Meta(i32(0, 3, 6)))
        out = good.run_prefill_new_tokens(q, k, v, False)
        assert_close_to_reference(q, k, v, i32(0, 3, 6), None, True, out, scale=0.25)
        anonymous = make_backend(guarded.url)
        anonymous.prepare_metadata(Meta(i32(0, 3, 6)))
        with pytest.raises(zen_mla.UnauthorizedError, match="bearer token"):
            anonymous.run_prefill_new_tokens(q, k, v, False)


@pytest.mark.slow
def test_outages_at_start_and_mid_run_are_computed_here_and_the_service_found_again(
    tmp_path, caplog
):
    """Down at start, up, killed mid-run, up again, at one URL: every call answers the fp64
    reference, the service's own counter shows the calls that went to it, and each change is
    one log line."""
    port = free_port()
    b = make_backend(f"http://127.0.0.1:{port}", heads=MLA)
    b.settings = RemoteSettings(
        urls=b.settings.urls, probe_interval_s=0.2, probe_max_interval_s=0.5
    )
    b = b.clone()  # the clone keeps these settings: the link probes every 0.2-0.5 s
    b.prepare_metadata(Meta(i32(0, 5, 12)))
    q, k = (torch.randn(12, 4, 192, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(12, 4, 128, dtype=torch.bfloat16)
    want_out, want_lse = attention_fp64(q, k, v, [0, 5, 12], [0, 5, 12], causal=True, scale=0.25)

    def step(where):
        before = vllm.stats.snapshot()
        out, lse = b.run_prefill_new_tokens(q, k, v, True)
        assert close_to_fp64(out, want_out) and close_to_fp64(lse, want_lse, atol=1e-3)
        after = vllm.stats.snapshot()
        assert (after.remote - before.remote, after.local - before.local) == (
            (1, 0) if where == "service" else (0, 1)
        )

    log = tmp_path / "server.log"
    with caplog.at_level(logging.INFO, logger="zen_mla.vllm"):
        step("here")  # nothing listens yet
        assert not b.link.up
        with serve_on(port, log) as first:
            wait_for(lambda: b.link.up, 60, "the link did not find the service again")
            step("service")
            assert requests_answered(first, 1) == 1
            kill(first)
            step("here")
            step("here")
            assert not b.link.up
        with serve_on(port, log) as second:
            wait_for(lambda: b.link.up, 60, "the link did not find the service again")
            step("service")
            assert requests_answered(second, 1) == 1
    said = [r.getMessage() for r in caplog.records if r.name == "zen_mla.vllm"]
    down = [m for m in said if "gave no answer" in m]
    back = [m for m in said if "is back after" in m]
    assert len(down) == 2 and len(back) == 2, said
    assert "1 calls were computed in this process" in back[0]
    assert "2 calls were computed in this process" in back[1]


@pytest.mark.slow
def test_without_the_fallback_a_killed_service_is_an_error(tmp_path):
    port = free_port()
    with serve_on(port, tmp_path / "server.log") as s:
        b = make_backend(s.url)
        b = type(b)(
            4, 0.25, 512, 16, 0, 16, None, settings=RemoteSettings(urls=(s.url,), fallback=False)
        )
        b.prepare_metadata(Meta(i32(0, 3, 6)))
        q, k, v = (torch.randn(6, 4, 16, dtype=torch.bfloat16) for _ in range(3))
        b.run_prefill_new_tokens(q, k, v, False)
        kill(s)
        with pytest.raises(zen_mla.ServiceUnavailableError):
            b.run_prefill_new_tokens(q, k, v, False)
