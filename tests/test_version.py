"""`zen_mla.__version__` is the installed distribution's, whose one literal is pyproject.toml's;
a source tree that was never installed says so rather than a number it cannot know."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import zen_mla

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_is_the_installed_distribution_s() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert zen_mla.__version__ == importlib.metadata.version(project["name"])
    assert zen_mla.__version__ == project["version"]


def test_a_tree_never_installed_says_its_version_is_unknown() -> None:
    code = (
        "import importlib.metadata as m\n"
        "def version(name):\n"
        "    raise m.PackageNotFoundError(name)\n"
        "m.version = version\n"
        "import zen_mla\n"
        "print(zen_mla.__version__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "0+unknown"
