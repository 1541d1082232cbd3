"""Docs that cannot drift: every path, flag, default, route, status code and environment
variable that README.md, CHANGELOG.md (paths only) and docs/*.md name is checked here against
the code (the tree, `zen-mla`'s parser, the bench scripts' flags, `Settings`, the app's routes,
zen_mla/errors.py's status table), because the manual is written by hand and the code moves
under it. Each check is a function `check_xxx(doc_name, text) -> list[str]` that returns one
`file:line: what` line per mismatch, so a test reports them all at once, and the self-tests at
the bottom plant one error of each kind to prove the checks still catch them."""

from __future__ import annotations

import argparse
import ast
import fnmatch
import functools
import itertools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from pydantic import SecretStr

from service.cli import build_parser, is_secret
from service.settings import Settings
from zen_mla import errors
from zen_mla.envs import VARIABLES, Variable
from zen_mla.errors import STATUS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: the folders of the tree a doc names by path, and its files at the top
TOP_FOLDERS = ("zen_mla", "service", "tests", "bench", "docs", "scripts", "deploy", "fuzz", ".ci")
TOP_FILES = {
    "Dockerfile",
    "docker-compose.yml",
    "pyproject.toml",
    "setup.py",
    "README.md",
    "CHANGELOG.md",
    ".gitignore",
    ".dockerignore",
}
#: a path without its top folder (`pool/_direct.py`) is looked up below these, then anywhere
PACKAGES = ("zen_mla", "service")
#: paths the docs name that a run makes, not the tree, with what makes them (a path .gitignore
#: names counts as made by a run too: `bench/out/`)
MADE_BY_A_RUN = {"fuzz/corpus": "fuzz/fuzz_wire.py makes the corpus folder it is given"}

#: flags of tools other than zen-mla's, and the tool each belongs to
FOREIGN_FLAGS = {
    "--attention-backend": "vllm serve",
    "--attention-config": "vllm serve",
    "--no-build-isolation": "pip",
    "--topology-manager-policy": "kubelet",
    "--builtin-schema": "check-jsonschema",
    "--profile": "docker compose",
}
#: pytest's own flags the docs may name (its short ones, `-m`, `-k`, are not checked)
PYTEST_FLAGS = {
    "--collect-only",
    "--co",
    "--lf",
    "--ff",
    "--last-failed",
    "--maxfail",
    "--durations",
    "--tb",
    "--strict-markers",
    "--help",
}
#: flags that stand for any flag (`zen-mla serve --flag`)
PLACEHOLDER_FLAGS = {"--flag"}

#: Settings fields whose default is worked out at run time (the field's default is None), and
#: where: the settings table says it in words
COMPUTED_DEFAULTS = {
    "shm_socket": "Settings.regions_socket: next to --uds, else /tmp/zen-mla-<uid>/...",
    "shm_max_total_bytes": "the regions' registry: the host's memory",
}

#: the app's own route prefixes: a backticked token starting with one is a route
ROUTE_PREFIXES = ("/prefill", "/health", "/metrics", "/v2")
#: the codes FastAPI answers by itself: 200, routing's 404 (no route) and 405 (another method),
#: request validation's 422
FRAMEWORK_STATUSES = {200, 404, 405, 422}

SHELLS = {"", "bash", "sh", "shell", "console", "zsh", "text"}


def _docs() -> list[str]:
    names = ["README.md", "CHANGELOG.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
    return sorted({n for n in names if (ROOT / n).is_file()}, key=lambda n: (n[:5] == "docs/", n))


DOCS = _docs()
MANUAL = [d for d in DOCS if d != "CHANGELOG.md"]


# -- reading markdown -----------------------------------------------------------------------

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})([^\n]*)\n(.*?)^ {0,3}\1[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(?<![`\\])(`+)(?!`)((?:[^\n]|\n(?![ \t]*\n))+?)(?<!`)\1(?!`)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)


def _blank(match: re.Match[str]) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def _prose(text: str, spans: bool = False) -> str:
    """`text` with its fenced blocks (and, asked, its code spans) blanked, offsets kept."""
    text = FENCE.sub(_blank, text)
    return SPAN.sub(_blank, text) if spans else text


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _spans(text: str) -> Iterator[tuple[int, str]]:
    """Each inline code span: its offset and its text, whitespace runs as one space."""
    for m in SPAN.finditer(_prose(text)):
        yield m.start(), " ".join(m.group(2).split())


def _shell_lines(text: str) -> Iterator[tuple[int, str]]:
    """Each command of the shell blocks (continued lines joined, comments cut): its offset."""
    for m in FENCE.finditer(text):
        if m.group(2).strip().lower() not in SHELLS:
            continue
        offset, pending, start = m.start(3), "", 0
        for raw in m.group(3).splitlines(keepends=True):
            if not pending:
                start = offset
            body = raw.rstrip("\n")
            offset += len(raw)
            if body.rstrip().endswith("\\"):
                pending += body.rstrip()[:-1] + " "
                continue
            line = re.sub(r"(^|\s)#.*", "", pending + body)
            pending = ""
            if line.strip():
                yield start, line.strip()


def _segments(command: str) -> list[list[str]]:
    """The simple commands of a command line, as words."""
    return [part.split() for part in re.split(r"\s(?:&&|\|\||;|\|)\s", command) if part.split()]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text lowercased, punctuation but `-` and `_`
    dropped, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    for m in HEADING.finditer(_prose(text)):
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _cells(row: str) -> list[str]:
    """A table row's cells; a `|` in a code span or escaped stays in its cell."""
    cells, cell, code = [], "", False
    body = row.strip().removeprefix("|").removesuffix("|")
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and body[i + 1 : i + 2] == "|":
            cell, i = cell + "|", i + 2
            continue
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
        i += 1
    return [*cells, cell.strip()]


def _section(text: str, title: str) -> tuple[int, str] | None:
    """The section under the first heading (below the title's) that starts with `title`: its
    offset and text, up to the next heading of its level or above."""
    prose = _prose(text)
    for m in HEADING.finditer(prose):
        if len(m.group(1)) > 1 and m.group(2).strip().startswith(title):
            level = len(m.group(1))
            end = next(
                (n.start() for n in HEADING.finditer(prose, m.end()) if len(n.group(1)) <= level),
                len(text),
            )
            return m.start(), text[m.start() : end]
    return None


def _rows(text: str, offset: int, section: str) -> Iterator[tuple[int, list[str]]]:
    """A section's table rows but headers and separators: each row's line and cells."""
    header = True
    pos = 0
    for raw in section.splitlines(keepends=True):
        line = raw.strip()
        if line.startswith("|"):
            if re.fullmatch(r"\|[\s:|-]+\|?", line):
                header = False
            elif not header:
                yield _line(text, offset + pos), _cells(line)
        else:
            header = True
        pos += len(raw)


# -- the tree -------------------------------------------------------------------------------


@functools.cache
def _ignore_patterns() -> tuple[str, ...]:
    path = ROOT / ".gitignore"
    lines = path.read_text().splitlines() if path.is_file() else []
    return tuple(p.strip() for p in lines if p.strip() and not p.startswith(("#", "!")))


def _ignored(rel: str) -> bool:
    """Whether .gitignore names `rel` (a run makes it; a fresh checkout lacks it)."""
    parts = rel.strip("/").split("/")
    for pattern in _ignore_patterns():
        p = pattern.strip("/")
        if "/" in pattern.rstrip("/"):
            prefixes = ("/".join(parts[: i + 1]) for i in range(len(parts)))
            if any(fnmatch.fnmatchcase(pre, p) for pre in prefixes):
                return True
        elif any(fnmatch.fnmatchcase(part, p) for part in parts):
            return True
    return False


@functools.cache
def _tree() -> dict[str, bool]:
    """Every file and folder of the working tree (ignored ones and .git left out): is a folder."""
    tree: dict[str, bool] = {}
    for folder, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        rel = "" if rel == "." else rel + "/"
        dirs[:] = [d for d in dirs if d != ".git" and not _ignored(rel + d)]
        tree.update({rel + d: True for d in dirs})
        tree.update({rel + f: False for f in files if not _ignored(rel + f)})
    return tree


def _placeholders(path: str) -> str:
    """`bench/NAME.py`, `docs/<topic>.md`: a segment in capitals or angle brackets is any."""
    path = re.sub(r"<[^>/]+>", "*", path)
    return "/".join(re.sub(r"^[A-Z][A-Z_]*(?=\.|$)", "*", s) for s in path.split("/"))


def _matches(pattern: str) -> list[str]:
    if any(c in pattern for c in "*?["):
        return [p for p in _tree() if fnmatch.fnmatchcase(p, pattern)]
    return [pattern] if pattern in _tree() else []


def _path_word(word: str) -> str | None:
    """The repository path a word of a code span names, None where it names none."""
    word = word.strip("\"'(),;").rstrip(".:")
    if "=" in word:
        word = word.split("=", 1)[1]
    word = word.removeprefix("./")
    if not word or word.startswith(("~", "/", "../", "$", "-")) or "://" in word:
        return None
    base = re.sub(r":\d+(?:-\d+)?$", "", word.split("::")[0])
    if ("/" in base and base.split("/")[0] in TOP_FOLDERS) or base in TOP_FILES:
        return word
    source = r"\.(?:py|pyi|cpp|c|h|hpp|md|toml|ya?ml|json|sh|txt|cfg|ini)"
    if re.fullmatch(rf"[\w.*-]+(?:/[\w.*<>-]+)+{source}", base):
        return word  # relative to a package: `pool/_direct.py`
    if re.fullmatch(r"test_\w+\.py|[\w-]+\.md", base):
        return word
    return None


def _check_path(doc_name: str, word: str) -> str | None:
    """What is wrong with a path a doc names (None: nothing): `path`, `path::test`, `path:LINE`,
    globs, `folder/`."""
    path, _, test = word.partition("::")
    line = None
    if m := re.fullmatch(r"(.*?):(\d+)(?:-\d+)?", path):
        path, line = m.group(1), int(m.group(2))
    folder = path.endswith("/")
    pattern = _placeholders(path.rstrip("/"))
    if pattern in MADE_BY_A_RUN or _ignored(pattern):
        return None
    doc_dir = os.path.dirname(doc_name)
    if pattern.split("/")[0] in TOP_FOLDERS or pattern in TOP_FILES:
        found = _matches(pattern)
    else:  # next to the doc, in a package, anywhere
        found = (
            (doc_dir and _matches(os.path.normpath(os.path.join(doc_dir, pattern))))
            or _matches(pattern)
            or [h for pkg in PACKAGES for h in _matches(f"{pkg}/{pattern}")]
            or _matches(f"*/{pattern}")
        )
    if not found:
        return f"`{word}`: no such file or folder"
    if folder and not any(_tree()[f] for f in found):
        return f"`{word}`: not a folder"
    files = [f for f in found if not _tree()[f]]
    if test and files:
        source = (ROOT / files[0]).read_text(errors="replace")
        for part in test.split("::"):
            name = part.split("[")[0]
            if not re.search(rf"\b{re.escape(name)}\b", source):
                return f"`{word}`: no `{name}` in {files[0]}"
    if line is not None and files:
        count = len((ROOT / files[0]).read_text(errors="replace").splitlines())
        if line > count:
            return f"`{word}`: {files[0]} has {count} lines"
    return None


def check_paths(doc_name: str, text: str) -> list[str]:
    """Every repository path in a code span or a shell block, and every link's target (with
    its anchor), exists."""
    problems = []
    words = [(o, w) for o, span in _spans(text) for w in span.split()]
    words += [(o, w) for o, command in _shell_lines(text) for w in command.split()]
    for offset, word in words:
        path = _path_word(word)
        if path is not None and (why := _check_path(doc_name, path)):
            problems.append(f"{doc_name}:{_line(text, offset)}: {why}")
    prose = _prose(text, spans=True)
    for m in itertools.chain(LINK.finditer(prose), REF_LINK.finditer(prose)):
        if why := _check_link(doc_name, text, m.group(1)):
            problems.append(f"{doc_name}:{_line(text, m.start())}: {why}")
    return problems


def _check_link(doc_name: str, text: str, target: str) -> str | None:
    if re.match(r"[a-z][a-z0-9+.-]*:", target) or not target:
        return None  # another site, mail
    path, _, anchor = unquote(target).partition("#")
    if path:
        rel = os.path.normpath(os.path.join(os.path.dirname(doc_name), path))
        if rel.startswith(".."):
            return None  # outside the repository
        if not (ROOT / rel).exists() and not _ignored(rel):
            return f"link `{target}`: no {rel}"
        target_text = (ROOT / rel).read_text() if rel.endswith(".md") else None
    else:
        rel, target_text = doc_name, text
    if anchor and target_text is not None and anchor not in _anchors(target_text):
        return f"link `{target}`: {rel} has no heading `#{anchor}`"
    return None


# -- flags ----------------------------------------------------------------------------------


@functools.cache
def _zen_mla_flags() -> dict[str, frozenset[str]]:
    """`zen-mla` and each of its subcommands ('zen-mla serve'): its flags."""
    out: dict[str, frozenset[str]] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        out[name] = frozenset(o for a in parser._actions for o in a.option_strings)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(subparser, f"{name} {sub}")

    walk(build_parser(), "zen-mla")
    return out


def _argument_flags(tree: ast.AST) -> set[str]:
    return {
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _name(node.func) == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value[:1] == "-"
    }


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


@functools.cache
def _script_flags() -> dict[str, frozenset[str]]:
    """Each script of bench/ and scripts/ written in Python: its flags, those its helpers in
    bench/_*.py add included (`c.service_cpus_option(parser)`)."""
    helpers: dict[str, set[str]] = {}
    for path in (ROOT / "bench").glob("_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and (flags := _argument_flags(node)):
                helpers[node.name] = flags
    out = {}
    scripts = [*(ROOT / "bench").glob("*.py"), *(ROOT / "scripts").glob("*")]
    for path in scripts:
        if path.name.startswith("_") or not path.is_file():
            continue
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue  # a shell script
        flags = _argument_flags(tree) | {"-h", "--help"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                flags |= helpers.get(_name(node.func), set())
        out[path.relative_to(ROOT).as_posix()] = frozenset(flags)
    return out


def _forwarded(script: str) -> list[str] | None:
    """The command a shell script hands its arguments to (`exec .venv/bin/zen-mla serve "$@"`)."""
    path = ROOT / script
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if '"$@"' in line]
    if not lines:
        return None
    words = lines[-1].split('"$@"')[0].split()
    return [w for w in words if w != "exec"]


def _every_flag() -> frozenset[str]:
    return frozenset().union(
        *_zen_mla_flags().values(), *_script_flags().values(), PYTEST_FLAGS, FOREIGN_FLAGS
    )


def _command_flags(words: list[str]) -> tuple[str, frozenset[str] | None]:
    """The command `words` run and the flags it takes; None where the command is none the docs
    know (a span that is a flag alone): any known flag then."""
    words = list(itertools.dropwhile(lambda w: re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w), words))
    if not words:
        return "", None
    prog, rest = words[0].removeprefix("./"), words[1:]
    if prog.startswith(".venv") or "/bin/" in prog:
        prog = prog.rsplit("/", 1)[-1]
    if re.fullmatch(r"python(3(\.\d+)?)?", prog) and rest:
        if rest[0] == "-m" and len(rest) > 1:
            prog, rest = rest[1], rest[2:]
        else:
            prog, rest = rest[0].removeprefix("./"), rest[1:]
    zen = _zen_mla_flags()
    if prog == "zen-mla":
        key = f"zen-mla {rest[0]}" if rest and f"zen-mla {rest[0]}" in zen else "zen-mla"
        return key, zen[key]
    scripts = _script_flags()
    if prog in scripts:
        return prog, scripts[prog]
    if re.fullmatch(r"bench/[A-Z_]+\.py", prog):  # bench/NAME.py: any of them
        return prog, frozenset().union(*(f for s, f in scripts.items() if s.startswith("bench/")))
    if prog.startswith("scripts/") and (forward := _forwarded(prog)):
        return _command_flags(forward)
    if prog == "pytest":
        return "pytest", frozenset(PYTEST_FLAGS)
    line = " ".join([prog, *rest])
    for tool in set(FOREIGN_FLAGS.values()):
        if line == tool or line.startswith(tool + " "):
            return tool, frozenset(f for f, t in FOREIGN_FLAGS.items() if t == tool)
    return "", None


FLAG = re.compile(r"(?:^|(?<=[\s\[(]))(--[A-Za-z0-9][A-Za-z0-9-]*)")


def check_flags(doc_name: str, text: str) -> list[str]:
    """Every `--flag` in a code span or a shell block is one of the command it is given to
    (zen-mla's subcommands, a bench script, pytest, a tool of FOREIGN_FLAGS), or, given to no
    command the docs know, one of any of them."""
    problems = []
    commands = [*_spans(text), *_shell_lines(text)]
    for offset, command in commands:
        for words in _segments(command):
            name, flags = _command_flags(words)
            for flag in FLAG.findall(" ".join(words)):
                known = _every_flag() if flags is None else flags
                if flag in known or flag in PLACEHOLDER_FLAGS:
                    continue
                whose = name or "zen-mla, the bench scripts, pytest or FOREIGN_FLAGS"
                problems.append(f"{doc_name}:{_line(text, offset)}: `{flag}` is no flag of {whose}")
    return problems


# -- settings -------------------------------------------------------------------------------


@functools.cache
def _defaults() -> dict[str, Any]:
    """Settings()'s values in an environment without ZEN_MLA_ variables (a secret unwrapped)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith("ZEN_MLA_"):
                mp.delenv(name)
        settings = Settings()
    return {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in settings}


_WORDS = object()  # a default written in words: computed at run time
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _value(cell: str) -> Any:
    """The value a settings table's default cell writes: `1 GiB`, `2^41`, `8000`, on/off, none,
    a string in backticks; _WORDS for anything else."""
    raw = cell.strip()
    code = raw.startswith("`") and raw.endswith("`") and len(raw) > 1
    raw = raw.strip("`").strip()
    low = raw.lower()
    if low in ("on", "off", "true", "false"):
        return low in ("on", "true")
    if low in ("none", "unset"):
        return None
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)", raw):
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    if m := re.fullmatch(r"(\d+)\s*(?:\^|\*\*)\s*(\d+)", raw):
        return int(m.group(1)) ** int(m.group(2))
    number = re.sub(r"(?<=\d)[,_](?=\d{3})", "", raw)
    for kind in (int, float):
        try:
            return kind(number)
        except ValueError:
            pass
    return raw if code else _WORDS


def _same(cell: str, value: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool) and value == default
    if isinstance(default, str):
        return cell.strip().strip("`").strip() == default
    if default is None or value is None:
        return value is default
    return isinstance(value, int | float) and value == default


def _row_fields(name_cell: str) -> tuple[list[str], list[str]]:
    """The flags and the variables a table row's first cell names."""
    names = re.findall(r"`([^`]+)`", name_cell)
    return [n for n in names if n.startswith("--")], [n for n in names if n.startswith("ZEN_")]


def check_settings_table(doc_name: str, text: str) -> list[str]:
    """The `## Settings` table: each row a serve flag (or a secret's variable) with its
    Settings default, and every serve flag and secret a row."""
    section = _section(text, "Settings")
    if section is None:
        return [f"{doc_name}:1: no `## Settings` section"]
    offset, body = section
    fields = Settings.model_fields
    defaults = _defaults()
    serve = set(_zen_mla_flags()["zen-mla serve"])
    problems, named = [], set()
    for line, cells in _rows(text, offset, body):
        where = f"{doc_name}:{line}"
        flags, variables = _row_fields(cells[0])
        if not flags and not variables:
            problems.append(f"{where}: the row names no flag or variable: {cells[0]!r}")
            continue
        if flags:
            flag, label = flags[0], flags[0]
            field = flag[2:].replace("-", "_")
            if flag not in serve:
                problems.append(f"{where}: `{flag}` is no flag of zen-mla serve")
            for other in flags[1:]:
                if other != f"--no-{flag[2:]}" or other not in serve:
                    problems.append(f"{where}: `{other}` is not `{flag}`'s negation in serve")
        else:
            label = variables[0]
            field = label.removeprefix("ZEN_MLA_").lower()
            if field in fields and not is_secret(fields[field]):
                problems.append(f"{where}: `{label}` has a flag, `--{field.replace('_', '-')}`")
        if field not in fields:
            problems.append(f"{where}: `{label}` names no Settings field")
            continue
        named.add(field)
        if len(cells) < 2:
            problems.append(f"{where}: `{label}` has no default cell")
            continue
        default, value = defaults[field], _value(cells[1])
        if value is _WORDS or field in COMPUTED_DEFAULTS:
            if field not in COMPUTED_DEFAULTS:
                problems.append(
                    f"{where}: `{label}`'s default {cells[1]!r} is no value; one computed at "
                    "run time goes in COMPUTED_DEFAULTS"
                )
            elif default is not None:
                problems.append(
                    f"{where}: `{label}` is in COMPUTED_DEFAULTS, but Settings' default is "
                    f"{default!r}"
                )
            continue
        if not _same(cells[1], value, default):
            problems.append(
                f"{where}: `{label}` defaults to {default!r} in Settings, the table says "
                f"{cells[1]!r}"
            )
    heading = _line(text, offset)
    for name, field in fields.items():
        if name not in named:
            what = f"ZEN_MLA_{name.upper()}" if is_secret(field) else "--" + name.replace("_", "-")
            problems.append(f"{doc_name}:{heading}: the settings table lacks `{what}`")
    return problems


# -- the environment ------------------------------------------------------------------------

CODE = (
    "zen_mla",
    "service",
    "setup.py",
    "scripts",
    "Dockerfile",
    "docker-compose.yml",
    "deploy",
)
_MISSING = object()  # read with no default


@functools.cache
def _code_text() -> str:
    parts = []
    for top in CODE:
        path = ROOT / top
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if not _ignored(rel) and f.suffix not in (".so", ".pyc", ".png"):
                parts.append(f.read_text(errors="replace"))
    return "\n".join(parts)


@functools.cache
def _env_reads() -> dict[str, list[Any]]:
    """Each ZEN_MLA_ variable the Python code reads by name (`environ.get`, `env.get`, `getenv`,
    `environ[...]`): the defaults it is read with (_MISSING: none)."""
    reads: dict[str, list[Any]] = {}
    paths = [
        ROOT / "setup.py",
        *(ROOT / "zen_mla").rglob("*.py"),
        *(ROOT / "service").rglob("*.py"),
    ]
    for path in paths:
        tree = ast.parse(path.read_text())
        constants = {
            t.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node.func) in ("get", "getenv", "pop"):
                args = node.args
            elif isinstance(node, ast.Subscript) and _name(node.value) == "environ":
                args = [node.slice]
            else:
                continue
            if not (args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)):
                continue
            if not args[0].value.startswith("ZEN_MLA_"):
                continue
            default: Any = _MISSING
            if len(args) > 1:
                arg = args[1]
                if isinstance(arg, ast.Constant):
                    default = arg.value
                elif isinstance(arg, ast.Name):
                    default = constants.get(arg.id, _WORDS)
                else:
                    default = _WORDS
            reads.setdefault(args[0].value, []).append(default)
    return reads


def _settings_variables() -> set[str]:
    return {f"ZEN_MLA_{name.upper()}" for name in Settings.model_fields}


ENV = re.compile(r"\bZEN_MLA_[A-Z0-9_]*[A-Z0-9]\b")


def check_env_vars(doc_name: str, text: str) -> list[str]:
    """Every ZEN_MLA_ variable named is a Settings field's or one the code spells out."""
    problems = []
    for m in ENV.finditer(text):
        name = m.group(0)
        if name in _settings_variables() or re.search(rf"\b{name}\b", _code_text()):
            continue
        problems.append(f"{doc_name}:{_line(text, m.start())}: `{name}` is read nowhere")
    return problems


def check_library_environment(doc_name: str, text: str) -> list[str]:
    """The `Environment of the library` table: a row for each variable of `zen_mla.envs`'s
    table, its default cell the table's `shown` and its meaning beginning with the table's
    (links and detail may follow); and for each variable the code still reads by name (setup.py
    at install: it cannot import the package it builds), its default the code's."""
    section = _section(text, "Environment of the library")
    if section is None:
        return [f"{doc_name}:1: no `## Environment of the library...` section"]
    offset, body = section
    reads = _env_reads()
    problems, named = [], set()
    for line, cells in _rows(text, offset, body):
        where = f"{doc_name}:{line}"
        _, variables = _row_fields(cells[0])
        if not variables:
            problems.append(f"{where}: the row names no variable: {cells[0]!r}")
            continue
        for name in variables:
            named.add(name)
            if name in VARIABLES:
                problems += _table_row_problems(where, VARIABLES[name], cells)
                continue
            if name not in reads:
                problems.append(f"{where}: `{name}`: no code reads it")
                continue
            if len(cells) < 2:
                continue
            given = {d for d in reads[name] if d is not _MISSING and d != ""}
            value = _value(cells[1])
            if len(given) > 1:
                problems.append(f"{where}: the code reads `{name}` with defaults {sorted(given)}")
            elif len(given) == 1 and _WORDS not in given:
                default = next(iter(given))
                if cells[1].strip().strip("`").strip() != str(default):
                    problems.append(
                        f"{where}: `{name}` defaults to {default!r} in the code, the table says "
                        f"{cells[1]!r}"
                    )
            elif value is None and _MISSING not in reads[name]:
                problems.append(f"{where}: `{name}` is always read with a default, not none")
    heading = _line(text, offset)
    for name in sorted(VARIABLES.keys() - named):
        problems.append(f"{doc_name}:{heading}: `{name}` is in zen_mla/envs.py; the table lacks it")
    for name in sorted(set(reads) - named - _settings_variables()):
        problems.append(f"{doc_name}:{heading}: the code reads `{name}`; the table lacks it")
    return problems


def _table_row_problems(where: str, variable: Variable[object], cells: list[str]) -> list[str]:
    """A docs row of a variable of `zen_mla.envs`: its default and meaning as the table's."""
    if len(cells) < 3:
        return [f"{where}: `{variable.name}`: expected a default and a meaning cell"]
    problems = []
    if cells[1].strip() != variable.shown:
        problems.append(
            f"{where}: `{variable.name}` defaults to {variable.shown} in zen_mla/envs.py, the "
            f"table says {cells[1].strip()}"
        )
    if not cells[2].strip().startswith(variable.meaning):
        problems.append(
            f"{where}: `{variable.name}`'s meaning should begin as zen_mla/envs.py's: "
            f"{variable.meaning!r}"
        )
    return problems


BY_HAND = re.compile(
    r"""(?:getenv|environ\.get|environ\.pop|environ)\s*[(\[]\s*["'](ZEN_MLA_\w+)"""
)


def check_source_variables(file_name: str, text: str) -> list[str]:
    """Every ZEN_MLA_ variable a source file names is one of `zen_mla.envs`'s table or a
    `Settings` field's, and none is read from the environment by hand: a variable read anywhere
    else would have a second home (and no row in docs/settings.md, whose two tables are held to
    those two)."""
    problems = [
        f"{file_name}:{_line(text, m.start())}: `{m.group(0)}` is in neither zen_mla/envs.py's "
        "table nor Settings"
        for m in ENV.finditer(text)
        if m.group(0) not in VARIABLES and m.group(0) not in _settings_variables()
    ]
    problems += [
        f"{file_name}:{_line(text, m.start())}: `{m.group(1)}` is read by hand; read it through "
        "zen_mla/envs.py's table (or Settings)"
        for m in BY_HAND.finditer(text)
    ]
    return problems


# -- routes ---------------------------------------------------------------------------------


@functools.cache
def _routes() -> dict[tuple[str, ...], frozenset[str]]:
    """The app's routes (made in process, no engine started): path segments -> methods."""
    from service.app import create_app

    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith("ZEN_MLA_"):
                mp.delenv(name)
        app = create_app(Settings())
    routes: dict[tuple[str, ...], frozenset[str]] = {}
    for route in app.routes:
        path = getattr(route, "path", None)
        if path is None:
            continue
        key = tuple(path.strip("/").split("/")) if path.strip("/") else ()
        routes[key] = routes.get(key, frozenset()) | frozenset(getattr(route, "methods", ()) or ())
    return routes


def _expand(route: str) -> list[str]:
    """`/a[/b]` -> /a, /a/b; `/{live,ready}` -> /live, /ready."""
    if m := re.search(r"\[([^\[\]]*)\]", route):
        return [
            *_expand(route[: m.start()] + route[m.end() :]),
            *_expand(route[: m.start()] + m.group(1) + route[m.end() :]),
        ]
    if m := re.search(r"\{([^{}]*,[^{}]*)\}", route):
        return [
            r
            for alt in m.group(1).split(",")
            for r in _expand(route[: m.start()] + alt.strip() + route[m.end() :])
        ]
    return [route]


def _fits(doc: tuple[str, ...], app: tuple[str, ...]) -> bool:
    """Whether a doc's route fits an app's: `{x}` on either side is any one segment, `...` is
    one segment or more (`.../ready`, `/v2/.../infer`)."""
    if not doc:
        return not app
    if doc[0] == "...":
        return any(_fits(doc[1:], app[i:]) for i in range(1, len(app) + 1))
    placeholder = re.compile(r"\{[^{}]+\}")
    head = doc[0] == app[0] if app else False
    head = head or bool(app and (placeholder.fullmatch(doc[0]) or placeholder.fullmatch(app[0])))
    return head and _fits(doc[1:], app[1:])


def _route_problem(route: str, method: str | None) -> str | None:
    shown = f"{method} {route}" if method else route
    route = re.split(r"[?#]", route)[0]
    for variant in _expand(route):
        segs = tuple(s for s in variant.strip("/").split("/") if s)
        matched = [methods for path, methods in _routes().items() if _fits(segs, path)]
        if not matched:
            return f"`{shown}`: no route `{variant}`"
        if method and not any(method in m for m in matched):
            takes = sorted(set().union(*matched))
            return f"`{shown}`: `{variant}` takes {', '.join(takes)}, not {method}"
    return None


METHOD_ROUTE = re.compile(
    r"\b(GET|HEAD|POST|PUT|PATCH|DELETE|OPTIONS)\s+((?:\.\.\.)?/[^\s`\"'<>()]*)"
)
LOCAL_URL = re.compile(
    r"https?://(?:127\.0\.0\.1|localhost|0\.0\.0\.0|\[::1\])(?::\d+)?(/[^\s`\"'<>()]*)"
)


def _trim(route: str) -> str:
    route = route.rstrip(".,;:")
    while route.endswith("]") and route.count("]") > route.count("["):
        route = route[:-1].rstrip(".,;:")
    return route


def _is_route(word: str) -> bool:
    return word.startswith(".../") or any(
        word == p or word.startswith((p + "/", p + "[", p + "?", p + "{")) for p in ROUTE_PREFIXES
    )


def check_routes(doc_name: str, text: str) -> list[str]:
    """Every `METHOD /path`, backticked route (`/prefill`, `/health...`, `/metrics`, `/v2...`,
    `.../suffix`) and local URL's path is a route of the app (taking that method)."""
    found: list[tuple[int, str, str | None]] = [
        (m.start(), _trim(m.group(2)), m.group(1)) for m in METHOD_ROUTE.finditer(text)
    ]
    for offset, span in _spans(text):
        word = _trim(span.split()[0]) if span.split() else ""
        if _is_route(word) and not METHOD_ROUTE.search(span):
            found.append((offset, word, None))
    for m in LOCAL_URL.finditer(text):
        if _is_route(_trim(m.group(1))):
            found.append((m.start(), _trim(m.group(1)), None))
    problems = []
    for offset, route, method in found:
        if why := _route_problem(route, method):
            problems.append(f"{doc_name}:{_line(text, offset)}: {why}")
    return problems


# -- status codes ---------------------------------------------------------------------------


def _ints(node: ast.AST) -> set[int]:
    return {
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and type(n.value) is int and 100 <= n.value <= 599
    }


@functools.cache
def _service_statuses() -> frozenset[int]:
    """What the service can answer: zen_mla/errors.py's table, the codes service/ writes out
    (`status_code=`, `"status":`, `responses=`), and FastAPI's own."""
    codes = set(STATUS.values()) | FRAMEWORK_STATUSES
    for path in (ROOT / "service").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg in ("status_code", "status"):
                codes |= _ints(node.value)
            elif isinstance(node, ast.keyword) and node.arg == "responses":
                if isinstance(node.value, ast.Dict):
                    codes |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "status":
                        codes |= _ints(value)
    return frozenset(codes)


def check_status_codes(doc_name: str, text: str) -> list[str]:
    """The protocol's status table (rows whose first cell starts with a 3-digit code): each
    code one the service answers, each exception a row names (`QueueFullError`) one that
    zen_mla/errors.py maps to that code, and every code of that table a row."""
    problems, named, first = [], set(), 1
    for m in re.finditer(r"^\|.*$", _prose(text), re.M):
        cells = _cells(m.group(0))
        cell = cells[0].replace("`", "").strip()
        if not re.match(r"\d{3}\b", cell):
            continue
        line = _line(text, m.start())
        first = first if named else line
        codes = set(map(int, re.findall(r"\b\d{3}\b", cell)))
        for code in sorted(codes):
            named.add(code)
            if code not in _service_statuses():
                problems.append(f"{doc_name}:{line}: the service never answers {code}")
        for name in re.findall(r"`(\w+Error)`", " ".join(cells[1:])):
            cls = getattr(errors, name, None)
            if not (isinstance(cls, type) and issubclass(cls, errors.ZenMLAError)):
                problems.append(f"{doc_name}:{line}: `{name}` is no class of zen_mla/errors.py")
                continue
            # status_of's rule, for a class: the first entry it is a subclass of
            status = next((s for c, s in STATUS.items() if issubclass(cls, c)), None)
            if status is None:
                problems.append(f"{doc_name}:{line}: `{name}` has no status in zen_mla/errors.py")
            elif status not in codes:
                problems.append(f"{doc_name}:{line}: `{name}` is answered {status}, not {cell}")
    for code in sorted(set(STATUS.values()) - named):
        problems.append(f"{doc_name}:{first}: the status table lacks {code} (zen_mla/errors.py)")
    return problems


# -- the tests ------------------------------------------------------------------------------


def _read(doc: str) -> str:
    return (ROOT / doc).read_text()


def _assert_none(problems: list[str]) -> None:
    assert not problems, f"{len(problems)} mismatches:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS)
def test_paths_exist(doc: str) -> None:
    _assert_none(check_paths(doc, _read(doc)))


@pytest.mark.parametrize("doc", MANUAL)
def test_flags_are_real(doc: str) -> None:
    _assert_none(check_flags(doc, _read(doc)))


@pytest.mark.parametrize("doc", MANUAL)
def test_routes_are_the_apps(doc: str) -> None:
    _assert_none(check_routes(doc, _read(doc)))


@pytest.mark.parametrize("doc", MANUAL)
def test_environment_variables_are_read(doc: str) -> None:
    _assert_none(check_env_vars(doc, _read(doc)))


def test_the_settings_table_matches_settings() -> None:
    _assert_none(check_settings_table("docs/settings.md", _read("docs/settings.md")))


def test_the_library_environment_table_matches_the_code() -> None:
    _assert_none(check_library_environment("docs/settings.md", _read("docs/settings.md")))


def test_every_variable_the_source_names_has_one_home() -> None:
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    _assert_none(
        [
            problem
            for path in files
            for problem in check_source_variables(str(path.relative_to(ROOT)), path.read_text())
        ]
    )


def test_the_protocols_status_codes_are_the_services() -> None:
    if not (ROOT / "docs/protocol.md").is_file():
        pytest.skip("docs/protocol.md is not written yet")
    _assert_none(check_status_codes("docs/protocol.md", _read("docs/protocol.md")))


def test_computed_defaults_are_fields() -> None:
    assert set(COMPUTED_DEFAULTS) <= set(Settings.model_fields)


def test_the_readme_opens_with_the_service_and_the_tests() -> None:
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None and text.index("```bash") < 200, "no command block on top"
    commands = [line.split("#")[0].split() for line in first_block.group(1).splitlines()]
    assert ["./scripts/serve"] in commands and ["./scripts/test"] in commands


def test_every_page_of_docs_is_reachable_from_the_readme() -> None:
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", README.read_text()))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"not linked from README.md: {sorted(pages - linked)}"


def test_the_readme_library_example_runs_as_written() -> None:
    """The README's library example, run as a user would paste it (the kernels of this host)."""
    section = README.read_text().split("## The library", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None, "no python block under ## The library"
    scope: dict[str, Any] = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)
    out, lse, heads = scope["out"], scope["lse"], scope["H"]
    assert out.shape == (3072, heads, 128) and lse.shape == (heads, 3072)


SETTINGS_ROW = "## Settings\n\n| flag | default | meaning |\n|---|---|---|\n| {} | {} | x |\n"
LIBRARY_ROW = (
    "## Environment of the library\n\n| variable | default | meaning |\n|---|---|---|\n"
    "| {} | {} | x |\n"
)

#: one planted error per check, and a fragment of the line that must report it
PLANTED: dict[str, tuple[Callable[[str, str], list[str]], str, str]] = {
    "path": (check_paths, "see `zen_mla/nope.py`", "planted.md:1: `zen_mla/nope.py`"),
    "test-id": (check_paths, "\n`tests/test_layout.py::test_nope`", ":2: `tests/test_layout.py::"),
    "line": (check_paths, "`setup.py:99999`", "setup.py has"),
    "link": (check_paths, "[x](nope.md)", "no docs/nope.md"),
    "anchor": (check_paths, "[x](settings.md#no-such)", "no heading `#no-such`"),
    "flag": (check_flags, "`--max-queu`", "`--max-queu` is no flag"),
    "serve-flag": (check_flags, "`zen-mla serve --timeout 3`", "no flag of zen-mla serve"),
    "no-flag": (check_flags, "`--no-port`", "`--no-port` is no flag"),
    "bench-flag": (check_flags, "```bash\npython bench/pool.py --seconds 3\n```", ":2: `--sec"),
    "default": (check_settings_table, SETTINGS_ROW.format("`--max-queue`", "9"), "says '9'"),
    "table-flag": (check_settings_table, SETTINGS_ROW.format("`--nope`", "1"), "`--nope` is"),
    "library": (
        check_library_environment,
        LIBRARY_ROW.format("`ZEN_MLA_KERNEL`", "`native`"),
        "`ZEN_MLA_KERNEL` defaults to `auto` in zen_mla/envs.py",
    ),
    "library-meaning": (
        check_library_environment,
        LIBRARY_ROW.format("`ZEN_MLA_KERNEL`", "`auto`"),
        "`ZEN_MLA_KERNEL`'s meaning should begin as",
    ),
    "library-lacks": (
        check_library_environment,
        LIBRARY_ROW.format("`ZEN_MLA_KERNEL`", "`auto`"),
        "`ZEN_MLA_URL` is in zen_mla/envs.py; the table lacks it",
    ),
    "source": (
        check_source_variables,
        'os.environ.get("ZEN_MLA_NOPE", "1")',
        "`ZEN_MLA_NOPE` is in neither",
    ),
    "by-hand": (
        check_source_variables,
        'os.environ.get("ZEN_MLA_URL", "http://a:1")',
        "`ZEN_MLA_URL` is read by hand",
    ),
    "route": (check_routes, "`POST /prefil`", "no route `/prefil`"),
    "span-route": (check_routes, "`/v2/model/x`", "no route `/v2/model/x`"),
    "method": (check_routes, "GET /prefill", "takes POST, not GET"),
    "ellipsis": (check_routes, "`/v2/.../infer/x`", "no route `/v2/.../infer/x`"),
    "env": (check_env_vars, "`ZEN_MLA_NOPE`", "`ZEN_MLA_NOPE` is read nowhere"),
    "status": (check_status_codes, "| 418 | teapot |", "never answers 418"),
    "status-class": (check_status_codes, "| 400 | `QueueFullError` |", "answered 429, not 400"),
}

CLEAN: dict[str, tuple[Callable[[str, str], list[str]], str]] = {
    "path": (check_paths, "`zen_mla/errors.py`, `pool/_direct.py`, [s](settings.md#settings)"),
    "flag": (check_flags, "`--max-queue`, `--no-smt`, `zen-mla health --timeout 2`"),
    "route": (
        check_routes,
        "`GET /health`, `/v2/models/m[/versions/1]`, `.../ready`, `POST /v2/.../infer`",
    ),
    "env": (check_env_vars, "`ZEN_MLA_URL`, `ZEN_MLA_MAX_QUEUE`, `ZEN_MLA_<FLAG>`"),
    "source": (
        check_source_variables,
        'ZEN_MLA_URL.read(), "ZEN_MLA_MAX_QUEUE", f"ZEN_MLA_{name.upper()}", ZEN_MLA_<FLAG>',
    ),
}


@pytest.mark.parametrize("case", PLANTED)
def test_a_planted_error_is_reported(case: str) -> None:
    check, text, expected = PLANTED[case]
    problems = check("docs/planted.md", text)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("case", CLEAN)
def test_a_true_text_passes(case: str) -> None:
    check, text = CLEAN[case]
    assert check("docs/planted.md", text) == []


def test_the_settings_tables_forms_are_read() -> None:
    rows = [
        ("`--max-body-bytes`", "1 GiB"),
        ("`--max-work`", "2^41"),
        ("`--min-body-rate`", "1000000"),
        ("`--smt` / `--no-smt`", "off"),
        ("`--uds`", "none"),
        ("`--host`", "`127.0.0.1`"),
        ("`--shm-socket`", "next to `--uds`, else a path under /tmp"),
        ("`ZEN_MLA_API_TOKEN`", "none"),
    ]
    table = SETTINGS_ROW.format(*rows[0]) + "".join(f"| {a} | {b} | x |\n" for a, b in rows[1:])
    problems = check_settings_table("docs/planted.md", table)
    assert not [p for p in problems if "lacks" not in p], problems
