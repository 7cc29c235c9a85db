"""The package's declared dependency ranges (pyproject.toml) admit only releases the code is safe on."""
from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the range is the same file on 3.10

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def requirement(name: str) -> Requirement:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == name)


def test_torch_range_starts_where_weights_only_loading_is_safe():
    """Every checkpoint, state and shard is read with `torch.load(weights_only=True)`, which torch 2.5
    and older let a crafted file bypass to run code (CVE-2025-32434, fixed in 2.6)."""
    torch = requirement("torch").specifier
    assert not torch.contains("2.5.1") and not torch.contains("2.4.0")
    assert torch.contains("2.6.0") and torch.contains("2.13.0")
    assert not torch.contains("2.15.0")  # the upper bound stays where it was tested
