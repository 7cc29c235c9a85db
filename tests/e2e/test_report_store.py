"""`python -m orchestrator report s3://...`: the run report of a run on S3 (a moto server on this
machine's loopback), read from the mirrored parts of its appended files. No Ray."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from actors.runs.mirror import RunMirror
from actors.runs.storage import open_storage
from testkit.harness import child_env

pytest.importorskip("matplotlib", reason="the report needs matplotlib (the [plot] extra)")
REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def run_folder(folder: Path) -> Path:
    """A two-member run of 40 steps with a death at step 20."""
    folder.mkdir()
    records = [{"step": step, "time": 1000.0 + step / 10, "loss": 2.0 / step, "world_size": 2 if step < 20 else 1,
                "membership_epoch": 1 if step < 20 else 2, "bytes_sent": 1000 * step, "slot": slot}
               for step in range(1, 41) for slot in ("w0", "w1")]
    events = [{"time": 1002.0, "kind": "reshape", "reason": "w1 died", "detail": {
        "old_members": ["w0", "w1"], "new_members": ["w0"], "joiners": [], "leavers": [], "detector": "actor death",
        "decided_at": 1001.95, "duration_s": 0.05}}]
    for name, lines in (("history.jsonl", records), ("events.jsonl", events),
                        ("step_times.jsonl", [{"time": 1000.0 + i, "step_s": {"w0": 0.01, "w1": 0.02}} for i in range(4)])):
        (folder / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "status.json").write_text(json.dumps({"state": "FINISHED", "step": 40}))
    (folder / "config.yaml").write_text("name: rep\nsync:\n  policy: dpsgd\n")
    return folder


def test_the_report_command_draws_a_run_on_s3(tmp_path, s3):
    local = run_folder(tmp_path / "run")
    uri = s3.format(prefix="reports")
    mirror = RunMirror(open_storage(uri), "rep/run1", local).start()
    for name in ("config.yaml", "status.json"):
        mirror.put(name)
    assert mirror.close(), mirror.error
    root, options = uri.split("?", 1)
    out = tmp_path / "r.png"
    drawn = subprocess.run([sys.executable, "-m", "orchestrator", "report", f"{root}/rep/run1?{options}", "--out", str(out)],
                           cwd=REPO, env=child_env(REPO), capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0 and out.read_bytes()[:8] == PNG and out.stat().st_size > 30_000, drawn.stderr
    assert "report:" in drawn.stdout and "s3://" not in drawn.stdout, drawn.stdout  # it names the PNG, not the store
    missing = subprocess.run([sys.executable, "-m", "orchestrator", "report", f"{root}/rep/none?{options}"],
                             cwd=REPO, env=child_env(REPO), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "not a run" in missing.stderr and missing.stderr.count("\n") == 1, missing.stderr
