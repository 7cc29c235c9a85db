"""Who writes each field: for every class in the given files, each `self.<field>` it assigns and the
classes of its inheritance chain (within those files) that assign the same field.

The rule it checks is the one the replica and the coordinator are built to: every field has one
writer class. A field that a base class declares and a subclass assigns (the shape of mixins that
share one `__init__`) has two writers and is reported; so is a class longer than `--max-lines`.

    python -m testkit.fields actors/training actors/control [--max-lines 300]

prints one line per class (its length and fields, each with its writer) and the violations; it exits
1 when there is one. `tests/unit/test_composition.py` runs it over the replica's and the coordinator's
packages.
"""
from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ClassFields:
    """One class: where it is, its base names, its length and the fields its methods assign."""

    name: str
    path: Path
    bases: tuple[str, ...]
    lines: int
    writes: set[str] = field(default_factory=set)
    declares: set[str] = field(default_factory=set)
    """Fields declared in the class body (a dataclass's), besides those its methods assign."""
    writes_into: set[str] = field(default_factory=set)
    """Fields it assigns on other objects (`member.cause = ...`): each counts as a write of that field by every
    class that declares it, the receiver's type being unknown here."""


def _assigned(target: ast.expr) -> list[str]:
    """The `self.<field>` names an assignment target writes (tuples unpacked)."""
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return [target.attr]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _assigned(element)]
    if isinstance(target, ast.Starred):
        return _assigned(target.value)
    return []


def _targets(cls: ast.ClassDef) -> list[ast.expr]:
    found: list[ast.expr] = []
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            found.extend(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            found.append(node.target)
    return found


def _flat(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for element in target.elts for t in _flat(element)]
    return [target.value] if isinstance(target, ast.Starred) else [target]


def _writes(cls: ast.ClassDef) -> set[str]:
    return {name for target in _targets(cls) for name in _assigned(target)}


def _writes_into(cls: ast.ClassDef) -> set[str]:
    """The fields the class's methods assign on objects other than `self` (a local's, a parameter's)."""
    out = set()
    for target in _targets(cls):
        for t in _flat(target):
            if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                out.add(t.attr)
    return out


def _declares(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _base_name(base: ast.expr) -> str:
    if isinstance(base, ast.Subscript):
        return _base_name(base.value)
    if isinstance(base, ast.Attribute):
        return base.attr
    return base.id if isinstance(base, ast.Name) else ""


def classes_in(paths: list[Path]) -> dict[str, ClassFields]:
    """Every top-level class of the `.py` files under `paths`, by name."""
    files = [p for path in paths for p in (sorted(path.rglob("*.py")) if path.is_dir() else [path])]
    found: dict[str, ClassFields] = {}
    for path in files:
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                end = node.end_lineno or node.lineno
                found[node.name] = ClassFields(node.name, path, tuple(_base_name(b) for b in node.bases),
                                               end - node.lineno + 1, _writes(node), _declares(node), _writes_into(node))
    return found


def chain(name: str, classes: dict[str, ClassFields]) -> list[str]:
    """The class and its bases among `classes`, nearest first."""
    seen: list[str] = []
    todo = [name]
    while todo:
        current = todo.pop(0)
        if current in classes and current not in seen:
            seen.append(current)
            todo.extend(classes[current].bases)
    return seen


def writers(name: str, classes: dict[str, ClassFields]) -> dict[str, list[str]]:
    """Each field the class (with its bases) has, and every class that writes it: those of its chain that
    assign it on `self`, and the other classes that assign a field of that name on another object, where the
    class declares it (a record such as a dataclass, written from outside)."""
    out: dict[str, list[str]] = {}
    for member in chain(name, classes):
        for attr in sorted(classes[member].writes):
            out.setdefault(attr, []).append(member)
    declared = {attr for member in chain(name, classes) for attr in classes[member].declares}
    for attr in sorted(declared):
        outside = [other for other, c in sorted(classes.items()) if attr in c.writes_into and other != name]
        if outside:
            out.setdefault(attr, []).extend(outside)
    return out


def violations(classes: dict[str, ClassFields], max_lines: int) -> list[str]:
    found = []
    for name, cls in sorted(classes.items()):
        if cls.lines > max_lines:
            found.append(f"{name} ({cls.path}) is {cls.lines} lines, over {max_lines}")
        for attr, who in writers(name, classes).items():
            if len(who) > 1 and (who[0] == name or attr in cls.declares):
                found.append(f"{name}.{attr} has {len(who)} writers: {', '.join(who)}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.fields", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--max-lines", type=int, default=300)
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        print(f"no such file or folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    classes = classes_in(args.paths)
    for name, cls in sorted(classes.items(), key=lambda item: str(item[1].path)):
        fields = writers(name, classes)
        listed = ", ".join(f"{attr} <- {'/'.join(who)}" for attr, who in fields.items())
        print(f"{cls.path}: {name} ({cls.lines} lines): {listed or '(no fields)'}")
    found = violations(classes, args.max_lines)
    largest = max(classes.values(), key=lambda c: c.lines, default=None)
    if largest is not None:
        print(f"largest class: {largest.name} ({largest.path}), {largest.lines} lines")
    for line in found:
        print(f"VIOLATION: {line}")
    print(f"{len(classes)} classes, {len(found)} violations")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
