"""`zen-mla`: the only place that reads argv and calls sys.exit.

    zen-mla serve [--host 127.0.0.1] [--port 8000] [--uds PATH] [--workers auto|N] ...
    zen-mla health [URL,...]  exit 0 when the service is ready (for container health checks)
    zen-mla status            this host's kernels, which "auto" takes and why, the CPU
    zen-mla bench [NAME ...]  run benchmarks under bench/ (kernel, pool, e2e by default)

Every serve flag is also an environment variable ZEN_MLA_<FLAG>; a flag wins over it.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import textwrap
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo

from zen_mla import InvalidInputError
from zen_mla.envs import DEFAULT_URL, LOCAL, ZEN_MLA_URL

from .settings import Settings

#: the plain types a flag takes, and how a choice between kinds names them (`auto|N`)
_PLAIN: dict[Any, str] = {int: "N", float: "X", str: "TEXT"}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _kinds(annotation: Any) -> list[Any]:
    """The types a field takes, None left out: `int | None` -> [int]."""
    if get_origin(annotation) in (Union, types.UnionType):
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def is_secret(field: FieldInfo) -> bool:
    """A secret is set through the environment only: a command line is visible to every user
    of the host (ps, /proc/PID/cmdline)."""
    return SecretStr in _kinds(field.annotation)


def _help(field: FieldInfo) -> str:
    text = (field.description or "").replace("%", "%%")  # argparse %-formats help
    if isinstance(field.default, bool):
        text += f" (default: {'on' if field.default else 'off'})"
    elif field.default is not None:
        text += f" (default: {field.default})"
    return text.strip()


def _argument(name: str, field: FieldInfo) -> dict[str, Any]:
    """add_argument's keywords for a Settings field, from its annotation and description. The
    flag's default is None whatever the field's: an unset flag leaves the field to Settings."""
    keywords: dict[str, Any] = {"dest": name, "default": None, "help": _help(field)}
    kinds = _kinds(field.annotation)
    if kinds == [bool]:
        return keywords | {"action": argparse.BooleanOptionalAction}
    literals = [v for k in kinds if get_origin(k) is Literal for v in get_args(k)]
    plain = [k for k in kinds if k in _PLAIN]
    if len(plain) + sum(get_origin(k) is Literal for k in kinds) != len(kinds):
        raise TypeError(
            f"Settings.{name}: no flag is made for a field of type {field.annotation!r}; "
            "expected bool, int, float, str, a Literal, a union of those, or a SecretStr "
            "(environment only). Teach service/cli.py the type, or change the field's"
        )
    if not literals and len(plain) == 1:
        return keywords | {"type": plain[0]}
    if not plain:
        return keywords | {"choices": literals}
    # a choice between kinds (`auto` or a number): the text goes as given, Settings decides
    return keywords | {"metavar": "|".join([*map(str, literals), *(_PLAIN[k] for k in plain)])}


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag for each Settings field but secrets: `max_queue` -> `--max-queue`. An unset flag
    stays None, so the environment's value or the field's default stands."""
    for name, field in Settings.model_fields.items():
        if not is_secret(field):
            parser.add_argument(_flag(name), **_argument(name, field))


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by the flags given (ValidationError if bad)."""
    given = {
        name: value
        for name, value in vars(args).items()
        if name in Settings.model_fields and value is not None
    }
    return Settings(**given)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"zen-mla serve: {exc}", file=sys.stderr)
        return 2
    if args.own_process:
        from .memory import exec_with_huge_pages

        exec_with_huge_pages()  # returns once the tunable is set, in this process or its start
    logging.basicConfig(level=settings.log_level.upper(), format="%(message)s")
    import torch

    # The server process only parses and copies; the workers compute. One thread here keeps
    # its OpenMP pool from spinning on cores the workers own.
    torch.set_num_threads(1)
    from .kserve.grpc_server import GrpcListenError
    from .memory import map_large_allocations
    from .server import build_server, raise_fd_limit

    map_large_allocations()
    try:
        build_server(settings, fd_limit=raise_fd_limit()).run()
    except GrpcListenError as exc:
        print(f"zen-mla serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _health(args: argparse.Namespace) -> int:
    """Each endpoint's `/health` (URL, or ZEN_MLA_URL's comma-separated endpoints); 0 when every
    one is ready."""
    import httpx

    try:
        urls = ZEN_MLA_URL.read() if args.url is None else ZEN_MLA_URL.check(args.url)
    except InvalidInputError:  # nothing but blanks and commas
        urls = ()
    if not urls or any(u.lower() == LOCAL for u in urls):
        given = ZEN_MLA_URL.name if args.url is None else "URL"
        print(
            f"zen-mla health: {given}: expected the service's URL (http://host:port), got "
            f"{','.join(urls)!r}",
            file=sys.stderr,
        )
        return 2
    urls = tuple(u.rstrip("/") for u in urls)
    ready = True
    for url in urls:
        try:
            response = httpx.get(url + "/health", timeout=args.timeout)
        except httpx.HTTPError as exc:
            print(f"{url}: unreachable: {exc}", file=sys.stderr)
            ready = False
            continue
        print(
            json.dumps(response.json(), indent=2) if len(urls) == 1 else f"{url}: {response.text}"
        )
        ready = ready and response.status_code == 200
    return 0 if ready else 1


def _status(args: argparse.Namespace) -> int:
    import zen_mla

    print(json.dumps(zen_mla.host_kernels(), indent=2))
    return 0


#: every benchmark under bench/ (a script of its own), and those `zen-mla bench` runs unnamed
BENCHES = (
    "kernel",
    "pool",
    "e2e",
    "floor",
    "step",
    "copies",
    "vllm_backend",
    "load",
    "gpu",
    "scaling",
    "charges",
    "vllm_ttft",
    "balance",
    "latent",
    "latent_call",
)
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

    secrets = [
        textwrap.fill(
            f"ZEN_MLA_{name.upper()}: {field.description}",
            initial_indent="  ",
            subsequent_indent="    ",
        )
        for name, field in Settings.model_fields.items()
        if is_secret(field)
    ]
    serve = commands.add_parser(
        "serve",
        help="run the HTTP service",
        description="Every flag is also the environment variable ZEN_MLA_<FLAG> (--max-queue:\n"
        "ZEN_MLA_MAX_QUEUE); a flag wins over it, and either over the default shown.",
        epilog="\n".join(
            ["environment only (a command line is visible to every user of the host):", *secrets]
        )
        if secrets
        else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_flags(serve)
    serve.set_defaults(run=_serve)

    health = commands.add_parser("health", help="check a running service's /health")
    health.add_argument(
        "url",
        nargs="?",
        help=f"the service, or several, comma-separated (default: ZEN_MLA_URL, else {DEFAULT_URL})",
    )
    health.add_argument("--timeout", type=float, default=5.0)
    health.set_defaults(run=_health)

    status = commands.add_parser(
        "status", help='print this host\'s kernels, what "auto" takes and why, and the CPU'
    )
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
    args.own_process = argv is None  # the process's own command line: it may start anew
    sys.exit(args.run(args))
