"""The README is where users look first: it opens with the two commands that work on a fresh
machine (the service, the tests), and its settings table names every flag `zen-mla serve`
has (the flags are made from `Settings`; the table is written by hand)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from service.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def _serve_flags() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [
        a.option_strings[0]
        for a in sub.choices["serve"]._actions
        if a.option_strings and a.option_strings[0] not in ("-h", "--help")
    ]


def test_the_readme_opens_with_the_service_and_the_tests():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None and text.index("```bash") < 200, "no command block on top"
    commands = [line.split("#")[0].split() for line in first_block.group(1).splitlines()]
    assert ["./scripts/serve"] in commands and ["./scripts/test"] in commands


def test_the_settings_table_names_every_serve_flag():
    table = README.read_text().split("### Settings", 1)[1].split("\n## ", 1)[0]
    missing = [flag for flag in _serve_flags() if f"`{flag}`" not in table]
    assert not missing, f"README's settings table lacks {missing}"
