"""Folders import in one direction: orchestrator/ -> actors/ -> algorithms/ -> core/, and the two
bottom layers (pure decisions and the shared vocabulary) never import Ray."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAYERS = {"core": 0, "algorithms": 1, "actors": 2, "orchestrator": 3}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_each_folder_imports_only_itself_and_the_folders_below():
    wrong = []
    for package, rank in LAYERS.items():
        for path in sorted((REPO / package).rglob("*.py")):
            for name in imports(path) & set(LAYERS):
                if LAYERS[name] > rank:
                    wrong.append(f"{path.relative_to(REPO)} imports {name}")
    assert not wrong, wrong


def test_decisions_and_vocabulary_never_import_ray():
    offenders = [str(p.relative_to(REPO)) for package in ("core", "algorithms")
                 for p in (REPO / package).rglob("*.py") if "ray" in imports(p)]
    assert not offenders, offenders


def test_test_files_have_unique_basenames():
    """tests/ has no __init__.py: pytest imports each test file by its basename, so two files with one
    name in different folders fail the whole collection."""
    from collections import Counter

    names = Counter(p.name for p in (REPO / "tests").rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], names
