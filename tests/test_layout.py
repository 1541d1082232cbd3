"""The tree shows the architecture (docs/architecture.md): no import circle among the project's
modules (imports inside functions count, `TYPE_CHECKING` blocks do not), imports flow one way
(`service` -> `zen_mla`), a file past 400 lines is named for review and none passes 600, few
modules loose at `zen_mla/`'s top, and every name one module imports from another is in that
module's `__all__`."""

from __future__ import annotations

import ast
import importlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zen_mla", "service")
# Size is a signal, cohesion the rule: one class lives in one file even past `LONG_LINES`, and
# two jobs in one file are split even under it. So a file past `LONG_LINES` is named (a
# `LongFileWarning`, in pytest's warnings summary) for a reviewer to ask whether it holds one
# job, and never fails for its size alone; past `MAX_LINES` it fails: no one job needs that
# much, and a file that long hides a second one.
LONG_LINES = 400
MAX_LINES = 600
MAX_LOOSE = 8


class LongFileWarning(UserWarning):
    """A file past `LONG_LINES`: one job still, or two to split? (a note for review)"""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, in functions too, but not under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            for other in node.orelse:  # only the else branch runs
                if isinstance(other, ast.Import | ast.ImportFrom):
                    yield other
                yield from _imports(other)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports(node)


def imported(name: str) -> Iterator[tuple[str, list[str]]]:
    """(module imported, names taken from it) for each import of module `name`; a name that
    is itself a submodule is yielded as a module."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if is_package(name) else name.rpartition(".")[0]
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            target = ".".join([*base, node.module] if node.module else base)
        else:
            target = node.module or ""
        names = [a.name for a in node.names]
        subs = [n for n in names if f"{target}.{n}" in MODULES]
        yield target, [n for n in names if n not in subs]
        for sub in subs:
            yield f"{target}.{sub}", []


def edges() -> dict[str, set[str]]:
    """Module -> project modules it runs on import: what it names, and the packages above
    those (their `__init__` runs first) that are not its own."""
    graph: dict[str, set[str]] = {}
    for name in MODULES:
        out = graph.setdefault(name, set())
        for target, _ in imported(name):
            if target not in MODULES:
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                ancestor = ".".join(parts[:i])
                if ancestor in MODULES and not (name + ".").startswith(ancestor + "."):
                    out.add(ancestor)
            out.discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle():
    cycle = find_cycle(edges())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_flow_from_service_to_zen_mla_only():
    for name, targets in edges().items():
        if name.startswith("zen_mla"):
            assert not any(t.startswith("service") for t in targets), name


def check_size(where: str, lines: int) -> None:
    """Fail past `MAX_LINES`; past `LONG_LINES`, a `LongFileWarning` naming the file."""
    assert lines <= MAX_LINES, f"{where}: {lines} lines (at most {MAX_LINES}: split it by job)"
    if lines > LONG_LINES:
        warnings.warn(
            f"long file: {where}: {lines} lines (past {LONG_LINES}: does it hold one job?)",
            LongFileWarning,
            stacklevel=2,
        )


# pyproject's filterwarnings makes every warning an error; a mark overrides it for this one
# category, which is reported (always: one line per file) and fails nothing.
SHOW_LONG_FILES = pytest.mark.filterwarnings(f"always::{__name__}.LongFileWarning")


@SHOW_LONG_FILES
@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_file_is_too_long(name):
    """Size is a signal for review, cohesion the rule (see `LONG_LINES`): past 400 lines a file
    is named in the warnings summary; past 600 it fails."""
    check_size(str(MODULES[name].relative_to(ROOT)), MODULES[name].read_text().count("\n"))


@SHOW_LONG_FILES
def test_the_size_check_names_a_long_file_and_fails_a_longer_one():
    check_size("short", LONG_LINES)  # neither
    with pytest.warns(LongFileWarning, match="long: 401 lines"):
        check_size("long", LONG_LINES + 1)
    with pytest.raises(AssertionError, match="longer: 601 lines"):
        check_size("longer", MAX_LINES + 1)


def test_few_modules_loose_at_the_top():
    loose = sorted(p.name for p in (ROOT / "zen_mla").glob("*.py"))
    assert len(loose) <= MAX_LOOSE, loose


def test_what_one_module_imports_from_another_is_in_its_all():
    missing = []
    for name in MODULES:
        for target, names in imported(name):
            if target not in MODULES or target == name:
                continue
            if (name + ".").startswith(target + "."):
                continue  # a package's own __init__, read by its modules
            public = getattr(importlib.import_module(target), "__all__", None)
            if public is None:
                continue
            missing += [f"{name}: {target}.{n}" for n in names if n not in public and n != "*"]
    assert not missing, "\n".join(missing)


def test_the_service_talks_to_the_engine_not_the_pool():
    """`service` gets what it needs of compute (buffers, output places, a worker's reply) from
    `zen_mla.engine` and `zen_mla.regions`' public names, never from the pool behind them."""
    reaching = [
        f"{name} -> {target}"
        for name in MODULES
        if name.startswith("service")
        for target, _ in imported(name)
        if target.startswith(("zen_mla.pool", "zen_mla.regions."))
    ]
    assert not reaching, "\n".join(reaching)


def test_the_service_state_knows_no_protocol():
    targets = [target for target, _ in imported("service.state")]
    assert not [t for t in targets if t.startswith("service.kserve")], targets


# What a request's life is made of; each is used by the one pipeline only: the engine's
# `prepare` and `run`, admission's `admit`, `admit_read` and `check_queue`, the body reader.
ENGINE_USES = ("prepare", "run")
ADMISSION_USES = ("admit", "admit_read", "check_queue")
READER = "read_body"
PIPELINE = "service.pipeline"
#: the pipeline's run phase, which only the pipeline calls
RUN = "service.compute"


def _life_uses(name: str) -> set[str]:
    """What of a request's life module `name` uses: `engine.prepare` / `x.engine.run` (used,
    called or passed), `x.admit(...)` and the like, `read_body`."""
    used = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Attribute):
            owner = ast.unparse(node.value)
            if node.attr in ENGINE_USES and owner.split(".")[-1] == "engine":
                used.add(f"engine.{node.attr}")
            if node.attr in ADMISSION_USES:
                used.add(node.attr)
        elif isinstance(node, ast.Name) and node.id == READER:
            used.add(READER)
    return used


def test_a_request_s_life_is_assembled_in_one_module_of_the_service():
    """The engine's `prepare` and `run`, admission and the body reader are used by
    `service.pipeline` alone (`run` by its run phase, `service.compute`, which the pipeline
    alone imports): every form and door goes through it."""
    others = {
        name: sorted(_life_uses(name))
        for name in MODULES
        if name.startswith("service") and name not in (PIPELINE, RUN, "service.admission")
    }
    assert not {name: uses for name, uses in others.items() if uses}
    everything = {*(f"engine.{u}" for u in ENGINE_USES), *ADMISSION_USES, READER}
    assert _life_uses(PIPELINE) | _life_uses(RUN) == everything
    assert {name for name in MODULES for target, _ in imported(name) if target == RUN} == {PIPELINE}


def test_the_pipeline_is_called_by_the_routes_and_calls_nothing_back():
    """Routes hand a (door, form) to the pipeline; forms, doors and the body reader it calls
    never import it, so a request's walk only goes down (route > pipeline > form, body >
    engine)."""
    importers = {name for name in MODULES for target, _ in imported(name) if target == PIPELINE}
    assert importers <= {
        "service.routes.prefill",
        "service.routes.weights",
        "service.routes.calls",
        "service.kserve.routes",
        "service.kserve.grpc_server",
    }
    below = [name for name in MODULES if name.startswith(("service.forms", "service.doors"))]
    for name in below:
        assert not [t for t, _ in imported(name) if t.startswith("service.routes")], name
