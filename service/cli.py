"""`zen-mla`: the only place that reads argv and calls sys.exit.

    zen-mla serve [--host 127.0.0.1] [--port 8000] [--uds PATH] [--workers auto|N] ...
    zen-mla health URL        exit 0 when the service is ready (for container health checks)
    zen-mla status            zentorch and CPU facts of this host
    zen-mla bench [NAME ...]  run benchmarks under bench/ (kernel, pool, e2e by default)

Every serve flag is also an environment variable ZEN_MLA_<FLAG>; a flag wins over it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from .settings import Settings

    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        print(f"zen-mla serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(message)s")
    import torch

    # The server process only parses and copies; the workers compute. One thread here keeps
    # its OpenMP pool from spinning on cores the workers own.
    torch.set_num_threads(1)
    from .server import build_server, raise_fd_limit

    build_server(settings, fd_limit=raise_fd_limit()).run()
    return 0


def _health(args: argparse.Namespace) -> int:
    import httpx

    try:
        response = httpx.get(args.url.rstrip("/") + "/health", timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"unreachable: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(response.json(), indent=2))
    return 0 if response.status_code == 200 else 1


def _status(args: argparse.Namespace) -> int:
    import zen_mla

    print(json.dumps(zen_mla.zentorch_status(), indent=2))
    return 0


#: every benchmark under bench/ (a script of its own), and those `zen-mla bench` runs unnamed
BENCHES = ("kernel", "pool", "e2e", "floor", "step", "copies", "vllm_backend", "load")
DEFAULT_BENCHES = ("kernel", "pool", "e2e")


def _bench(args: argparse.Namespace) -> int:
    bench_dir = Path(__file__).resolve().parent.parent / "bench"
    if not bench_dir.is_dir():
        print(
            f"zen-mla bench: no bench/ folder at {bench_dir} (run from a checkout)", file=sys.stderr
        )
        return 2
    names = args.names or list(DEFAULT_BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"zen-mla bench: unknown {unknown}; expected among {list(BENCHES)}", file=sys.stderr)
        return 2
    for i, name in enumerate(names, 1):
        bar = "#" * i + "." * (len(names) - i)
        print(f"[{bar}] {i}/{len(names)} bench/{name}.py", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, str(bench_dir / f"{name}.py")], check=False)
        if done.returncode:
            return done.returncode
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zen-mla", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (default 8000)")
    serve.add_argument("--uds", help="serve on this Unix socket instead")
    serve.add_argument("--workers", help="'auto' (one per CCX, the default) or a number")
    serve.add_argument("--smt", action="store_const", const=True, help="use SMT siblings too")
    serve.add_argument("--max-body-bytes", dest="max_body_bytes", type=int)
    serve.add_argument("--max-queue", dest="max_queue", type=int)
    serve.add_argument("--deadline-s", dest="deadline_s", type=float)
    serve.add_argument("--max-work", dest="max_work", type=int)
    serve.add_argument("--max-seqs", dest="max_seqs", type=int)
    serve.add_argument("--drain-timeout-s", dest="drain_timeout_s", type=float)
    serve.add_argument("--max-uploads", dest="max_uploads", type=int)
    serve.add_argument("--max-inflight-bytes", dest="max_inflight_bytes", type=int)
    serve.add_argument("--min-body-rate", dest="min_body_rate", type=float)
    serve.add_argument("--body-grace-s", dest="body_grace_s", type=float)
    serve.add_argument("--max-header-bytes", dest="max_header_bytes", type=int)
    serve.add_argument("--header-timeout-s", dest="header_timeout_s", type=float)
    serve.add_argument("--max-connections", dest="max_connections", type=int)
    serve.add_argument("--fd-reserve", dest="fd_reserve", type=int)
    serve.add_argument("--linger-s", dest="linger_s", type=float)
    serve.add_argument("--linger-bytes", dest="linger_bytes", type=int)
    serve.add_argument(
        "--shared-memory",
        dest="shared_memory",
        action=argparse.BooleanOptionalAction,
        help="offer same-host regions on a Unix socket (default: on)",
    )
    serve.add_argument("--shm-socket", dest="shm_socket", help="the regions' socket path")
    serve.add_argument("--shm-max-regions", dest="shm_max_regions", type=int)
    serve.add_argument("--shm-max-bytes", dest="shm_max_bytes", type=int)
    serve.add_argument("--shm-max-total-bytes", dest="shm_max_total_bytes", type=int)
    serve.add_argument("--shm-max-clients", dest="shm_max_clients", type=int)
    serve.add_argument("--shm-max-waiting", dest="shm_max_waiting", type=int)
    serve.add_argument(
        "--system-shm",
        dest="system_shm",
        action=argparse.BooleanOptionalAction,
        help="offer the v2 system shared memory extension (default: off)",
    )
    serve.add_argument("--system-shm-max-regions", dest="system_shm_max_regions", type=int)
    serve.add_argument("--system-shm-max-bytes", dest="system_shm_max_bytes", type=int)
    serve.add_argument("--max-json-bytes", dest="max_json_bytes", type=int)
    serve.add_argument("--http", choices=["httptools", "h11"])
    serve.add_argument("--log-level", dest="log_level")
    serve.set_defaults(run=_serve)

    health = commands.add_parser("health", help="check a running service's /health")
    health.add_argument(
        "url", nargs="?", default=os.environ.get("ZEN_MLA_URL", "http://127.0.0.1:8000")
    )
    health.add_argument("--timeout", type=float, default=5.0)
    health.set_defaults(run=_health)

    status = commands.add_parser("status", help="print zentorch's state and the CPU facts")
    status.set_defaults(run=_status)

    bench = commands.add_parser("bench", help="run the benchmarks (tables and plots)")
    bench.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"among {', '.join(BENCHES)} (default: {', '.join(DEFAULT_BENCHES)})",
    )
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.run(args))
