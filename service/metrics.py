"""Prometheus metrics, `zen_mla_*`, in the text exposition format (no client library)."""

from __future__ import annotations

import threading
from collections import defaultdict

# seconds; up to the default 60 s deadline
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.bytes_in = 0
        self.bytes_out = 0
        self.tokens: defaultdict[str, int] = defaultdict(int)
        self._hist: dict[str, list[int]] = {
            p: [0] * len(BUCKETS) for p in ("queue", "compute", "total")
        }
        self._sum: defaultdict[str, float] = defaultdict(float)
        self._count: defaultdict[str, int] = defaultdict(int)

    def observe(self, phase: str, seconds: float) -> None:
        with self._lock:
            for i, bound in enumerate(BUCKETS):
                if seconds <= bound:
                    self._hist[phase][i] += 1
            self._sum[phase] += seconds
            self._count[phase] += 1

    def count_request(self, route: str, status: int, bytes_in: int, bytes_out: int) -> None:
        with self._lock:
            self.requests[route, status] += 1
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out

    def count_tokens(self, q: int, kv: int) -> None:
        with self._lock:
            self.tokens["q"] += q
            self.tokens["kv"] += kv

    def render(
        self,
        queue_depth: int,
        uploads: int,
        workers_alive: int,
        worker_restarts: int,
        held_bytes: dict[str, int],
    ) -> str:
        out = []

        def family(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP zen_mla_{name} {help_}")
            out.append(f"# TYPE zen_mla_{name} {kind}")

        with self._lock:
            family(
                "requests_total",
                "counter",
                "Prefill requests answered, by route (prefill, v2, socket: a region-socket call) "
                "and HTTP status.",
            )
            for (route, status), n in sorted(self.requests.items()):
                out.append(f'zen_mla_requests_total{{route="{route}",status="{status}"}} {n}')
            family("request_seconds", "histogram", "Prefill time by phase: queue, compute, total.")
            for phase, counts in self._hist.items():
                for bound, n in zip(BUCKETS, counts, strict=True):
                    out.append(
                        f'zen_mla_request_seconds_bucket{{phase="{phase}",le="{bound}"}} {n}'
                    )
                n = self._count[phase]
                out.append(f'zen_mla_request_seconds_bucket{{phase="{phase}",le="+Inf"}} {n}')
                out.append(f'zen_mla_request_seconds_sum{{phase="{phase}"}} {self._sum[phase]}')
                out.append(f'zen_mla_request_seconds_count{{phase="{phase}"}} {self._count[phase]}')
            family("received_bytes_total", "counter", "Request body bytes read.")
            out.append(f"zen_mla_received_bytes_total {self.bytes_in}")
            family("sent_bytes_total", "counter", "Response body bytes sent.")
            out.append(f"zen_mla_sent_bytes_total {self.bytes_out}")
            family("tokens_total", "counter", "Query and key/value tokens computed.")
            for kind in ("q", "kv"):
                out.append(f'zen_mla_tokens_total{{kind="{kind}"}} {self.tokens[kind]}')
        family("queue_depth", "gauge", "Requests whose body is in, queued or computing.")
        out.append(f"zen_mla_queue_depth {queue_depth}")
        family("uploads", "gauge", "Request bodies being read.")
        out.append(f"zen_mla_uploads {uploads}")
        family(
            "held_bytes",
            "gauge",
            "Bytes held for requests, charged to their callers: bodies read, the kernels' memory "
            "of queued and running work, answers not yet sent.",
        )
        for kind, n in held_bytes.items():
            out.append(f'zen_mla_held_bytes{{kind="{kind}"}} {n}')
        family("workers_alive", "gauge", "Worker processes alive.")
        out.append(f"zen_mla_workers_alive {workers_alive}")
        family("worker_restarts_total", "counter", "Worker processes replaced after dying.")
        out.append(f"zen_mla_worker_restarts_total {worker_restarts}")
        return "\n".join(out) + "\n"
