"""Many clients at once on every route of a real server (the contract: "concurrent clients on
every route at once get only right answers, within their deadlines, with no worker
restarted"): region-socket calls, regions JSON over HTTP, safetensors over HTTP (answers of
2 MiB among them), `/v2` infer over HTTP and over gRPC, the async client, and calls over MLA's
latent cache (on the region socket and in safetensors bodies), mixed sizes, with
and without an LSE, each answer the library's own on the same tensors; with one worker and with
several. Then each path once more, one call at a time: a worker whose dispatcher thread lost
its way under the load answers nothing queued to it, though /health calls it alive and
unrestarted. Callers start no call after 20 s and give each 20 s, so that a run ends by itself
within a minute.

The callers and the tally are in tests/service/many_clients.py. Twelve calls are in flight at most
(eleven callers, one of them two tasks), under `--max-queue` 12: what is tested is right answers
under concurrency, not the queue's refusals (tests/service/test_shares.py). A 429 all the same is
retried after its Retry-After (the library clients do it themselves, the test's own callers
alike) and fails nothing unless the call fails in the end; the service's count of them is in the
summary."""

from __future__ import annotations

import os

import pytest

from bench._server import free_port
from tests.service.grpc_caller import grpc_caller
from tests.service.many_clients import (
    CALLERS,
    Case,
    Plan,
    answered_since,
    make_cases,
    run_all,
    server_state,
    then_each_path,
    timed,
)
from tests.service.servers import serve, wait_ready

DEADLINE_S = 10  # the server's; callers give a call 20 s, so that its 504 comes first
PLAN = Plan(calls=1000, seconds=20.0, timeout=20.0)
ROUTES = {
    "socket",
    "regions_http",
    "safetensors",
    "v2",
    "grpc",
    "async",
    "latent_socket",
    "latent_http",
}
CALLERS_AND_GRPC = [*CALLERS, ("grpc", grpc_caller, 1)]


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    return make_cases()


def _log_tail(text: str, lines: int = 30) -> str:
    marks = ('"status": 5', "Traceback", "rror", "worker", "stuck")
    hits = [line for line in text.splitlines() if any(m in line for m in marks)]
    return "\n".join(hits[-lines:])


@pytest.mark.slow
@pytest.mark.parametrize(
    "workers", [1, min(2, len(os.sched_getaffinity(0)))], ids=["1_worker", "n_workers"]
)
def test_many_clients_on_every_route_at_once(tmp_path, cases, workers):
    with serve(
        tmp_path, workers=workers, deadline_s=DEADLINE_S, max_queue=12, grpc_port=free_port()
    ) as server:
        wait_ready(server)
        before = server_state(server)
        with timed() as took:
            tally = run_all(server, cases, PLAN, callers=CALLERS_AND_GRPC)
        after = server_state(server)
        then_each_path(server, cases, PLAN, tally)
        final = server_state(server)
        logs = server.logs()

    problems = []
    if [o for o in tally.failures() if o.route != "after"] or tally.hung:
        problems.append("calls that failed, or callers that never finished")
    if [o for o in tally.failures() if o.route == "after"]:
        problems.append("calls made one at a time after the load failed")
    if missing := ROUTES - {o.route for o in tally.outcomes if o.kind == "ok"}:
        problems.append(f"no call answered right on {sorted(missing)}")
    if [(i, pid, n) for i, pid, n, _ in after.workers] != [
        (i, pid, n) for i, pid, n, _ in before.workers
    ] or after.restarts_total != before.restarts_total:
        problems.append("workers were replaced")
    if not all(alive for *_, alive in after.workers):
        problems.append("workers not alive after the run")
    if took[0] > 60:
        problems.append(f"the run took {took[0]:.0f} s")
    summary = (
        f"{workers} worker(s), {took[0]:.1f} s, {len(tally.outcomes)} calls:\n"
        f"{tally.report()}\n"
        f"  before: {before}\n  after:  {after}\n  final:  {final}\n"
        f"  the service answered: {answered_since(before, after)}"
    )
    print(summary)
    if problems:
        pytest.fail(
            f"{'; '.join(problems)}\n{summary}\n  server log, the lines that matter:\n"
            f"{_log_tail(logs)}",
            pytrace=False,
        )
