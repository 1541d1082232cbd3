"""`zen-mla`: the only place that reads argv and calls sys.exit."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _status(args: argparse.Namespace) -> int:
    import zen_mla

    print(json.dumps(zen_mla.zentorch_status(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zen-mla", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="print zentorch's state and the CPU facts")
    status.set_defaults(run=_status)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.run(args))
