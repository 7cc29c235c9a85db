"""Every repository file the docs name in backticks exists (a renamed or moved file leaves no stale
pointer: docs/lab.md once named `orchestrator/native/lab_bind.c` for `actors/native/lab_bind.c`)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"`((?:orchestrator|actors|algorithms|core|benchmarks|configs|tests|testkit|docs|\.ci)/[\w./-]*\.\w+)"
                   r"(?:::[\w\[\]-]+)*`")


def test_every_file_the_docs_name_exists():
    missing = [f"{doc.relative_to(REPO)}: {m.group(1)}"
               for doc in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
               for m in NAMED.finditer(doc.read_text()) if not (REPO / m.group(1)).exists()]
    assert not missing, missing
