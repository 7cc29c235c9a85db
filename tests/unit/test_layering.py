"""The folders say what lives in them, and imports follow them.

Each package below may import only the packages its row names (besides itself); the coordinator's
process (`actors/control/`, the torch-free rules it decides with, `core/`) never imports torch, at any
level; the bottom layers never import Ray; and no two modules import each other, directly or through
others, at module scope or inside a function. Run by the default tier; nothing here is an exception list: a new edge
is a change to the table, made on purpose."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOPS = ("core", "algorithms", "actors", "orchestrator", "testkit")

MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "algorithms": {"core"},  # the package itself (its __init__)
    "algorithms.rules": {"core"},
    "algorithms.policies": {"core", "algorithms.rules"},
    "actors": {"core", "algorithms.rules", "actors.transport"},  # what both processes share: plan.py, faults.py
    "actors.transport": {"core", "actors"},
    "actors.runs": {"core", "actors"},
    "actors.observe": {"core", "actors", "actors.runs"},
    "actors.control": {"core", "algorithms.rules", "actors", "actors.runs", "actors.observe", "actors.transport",
                       # the two actor classes it creates (each torch-free at import):
                       "actors.training.worker", "actors.server.server_actor"},
    "actors.training": {"core", "algorithms.rules", "algorithms.policies", "actors", "actors.transport", "actors.runs",
                        "actors.observe", "actors.server"},
    "actors.server": {"core", "algorithms.rules", "algorithms.policies", "actors", "actors.transport", "actors.runs",
                      "actors.observe", "actors.training"},
    "orchestrator": {"core", "algorithms.rules", "algorithms.policies", "actors", "actors.transport", "actors.runs",
                     "actors.observe", "actors.control", "actors.training", "actors.server"},
    "testkit": {"core", "algorithms.rules", "algorithms.policies", "actors", "actors.transport", "actors.runs",
                "actors.observe", "actors.control", "actors.training", "actors.server", "orchestrator"},
}
NO_TORCH = ("core", "algorithms.rules", "actors.control")
"""The coordinator's process: it loads no torch (its start and the CLI's status, scale and stop stay fast)."""
NO_RAY = ("core", "algorithms.rules", "algorithms.policies")


def package_of(module: str) -> str:
    """The table's row for a module: the longest row name that is a prefix of it."""
    rows = [row for row in MAY_IMPORT if module == row or module.startswith(row + ".")]
    return max(rows, key=len)


@functools.cache
def modules() -> dict[str, Path]:
    found = {}
    for top in TOPS:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imported(path: Path, at_run_time: bool = False) -> set[str]:
    """The absolute modules `path` imports, at module scope and inside functions alike: an import deferred
    into a function still runs, so it is an edge all the same. `from a.b import c` gives a.b.c when that is
    a module of ours, else a.b. With `at_run_time`, not those only the type checker reads (`if TYPE_CHECKING:`
    blocks, at any depth)."""
    known = modules()
    out: set[str] = set()
    pending: list[ast.AST] = [ast.parse(path.read_text())]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
        for child in ast.iter_child_nodes(node):
            if at_run_time and _type_checking(child):
                pending.extend(child.orelse)  # type: ignore[attr-defined]
            else:
                pending.append(child)
    return out


def test_each_package_imports_only_what_its_row_allows():
    known = modules()
    wrong = []
    for module, path in known.items():
        row = package_of(module)
        for name in imported(path):
            if name.split(".")[0] not in TOPS or name not in known:
                continue
            target = package_of(name)
            allowed = MAY_IMPORT[row] | {row}
            if target not in allowed and name not in allowed:  # a row, or one named module (an actor class)
                wrong.append(f"{path.relative_to(REPO)} ({row}) imports {name} ({target})")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_coordinators_process_imports_no_torch_and_the_bottom_no_ray():
    wrong = []
    for module, path in modules().items():
        row = package_of(module)
        names = {n.split(".")[0] for n in imported(path, at_run_time=True)}
        if row in NO_TORCH and "torch" in names:
            wrong.append(f"{path.relative_to(REPO)} imports torch")
        if row in NO_RAY and "ray" in names:
            wrong.append(f"{path.relative_to(REPO)} imports ray")
        if row == "actors.control" and any(n.startswith("algorithms.policies") for n in imported(path)):
            wrong.append(f"{path.relative_to(REPO)} imports a policy")
    assert not wrong, wrong


def test_no_import_cycle():
    """Tarjan's strongly connected components over the modules' imports, those inside functions included
    (a function-level import hides a cycle from the import system, not from the design), those under
    `if TYPE_CHECKING:` not (a package's `__init__` counts as the package): any component of more than one
    module is a cycle."""
    known = modules()
    graph = {m: sorted(n for n in imported(p, at_run_time=True) if n in known and n != m) for m, p in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_test_files_have_unique_basenames():
    """tests/ has no __init__.py: pytest imports each test file by its basename, so two files with one
    name in different folders fail the whole collection."""
    from collections import Counter

    names = Counter(p.name for p in (REPO / "tests").rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], names
