"""The run report (actors/observe/report.py, `python -m orchestrator report`): drawn from a run directory for
the one-reporter and per-member kinds, with its events classified; a directory that holds no run is
refused with exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the report needs matplotlib (the [plot] extra)")

from actors.observe import report

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def run_dir(tmp_path: Path, per_member: bool) -> Path:
    lines, t = [], 1000.0
    for step in range(1, 61):
        for slot in (("w0", "w1") if per_member else ("",)):
            world = 2 if 20 <= step < 35 else 3
            record = {"step": step, "time": t + step * 0.1, "loss": 2.0 / step, "world_size": world,
                      "membership_epoch": 1 if step < 20 else (2 if step < 35 else 3), "bytes_sent": 1000 * step,
                      "global_batch": 24}
            if slot:
                record["slot"] = slot
            if step % 20 == 0:
                record["metrics"] = {"accuracy": step / 60}
            lines.append(json.dumps(record))
    (tmp_path / "history.jsonl").write_text("\n".join(lines) + "\n")
    events = [
        {"time": t + 1.95, "kind": "reshape", "reason": "w2 died", "detail": {
            "old_members": ["w0", "w1", "w2"], "new_members": ["w0", "w1"], "joiners": [], "leavers": [],
            "detector": "actor death", "decided_at": t + 1.9, "duration_s": 0.06}},
        {"time": t + 3.5, "kind": "reshape", "reason": "replace w2", "detail": {
            "old_members": ["w0", "w1"], "new_members": ["w0", "w1", "w2"], "joiners": ["w2"], "leavers": [],
            "detector": "replacement", "decided_at": t + 1.9, "duration_s": 1.6}},
        {"time": t + 0.1, "kind": "transition", "reason": "started", "detail": {}},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "step_times.jsonl").write_text("".join(
        json.dumps({"time": t + i, "step_s": {"w0": 0.01, "w1": 0.03, **({"w2": 0.01} if i != 2 else {})}}) + "\n"
        for i in range(6)))
    (tmp_path / "status.json").write_text(json.dumps({"state": "FINISHED", "step": 60}))
    (tmp_path / "config.yaml").write_text("name: rep\nsync:\n  policy: " + ("shadow" if per_member else "bsp") + "\n")
    return tmp_path


@pytest.mark.parametrize("per_member", [False, True])
def test_the_report_draws_every_kind_of_run(tmp_path, per_member):
    out = report.draw(run_dir(tmp_path, per_member))
    assert out == tmp_path / "report.png" and out.read_bytes()[:8] == PNG and out.stat().st_size > 30_000
    kinds = [report.event_kind(e) for e in report.load(tmp_path)["events"]]
    assert kinds == ["death", "join", None]


def test_the_cli_draws_a_run_and_refuses_a_directory_that_holds_none(tmp_path):
    run = run_dir(tmp_path / "run", False) if (tmp_path / "run").mkdir() is None else None
    out = tmp_path / "r.png"
    ok = subprocess.run([sys.executable, "-m", "orchestrator", "report", str(run), "--out", str(out)], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and out.read_bytes()[:8] == PNG, ok.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = subprocess.run([sys.executable, "-m", "orchestrator", "report", str(empty)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_the_report_reads_a_run_from_its_store(tmp_path, capsys):
    """A run on an object store holds its appended files as mirrored parts (no `history.jsonl`): the
    report reads them through `read_appended`, from the run's URI (here fsspec's in-process `memory://`;
    tests/e2e/test_report_store.py runs the command line against an S3 server)."""
    from actors.runs.mirror import RunMirror
    from actors.runs.storage import open_storage
    from orchestrator.cli import main

    local = run_dir(tmp_path / "run", False) if (tmp_path / "run").mkdir() is None else tmp_path
    root = f"memory://reports-{tmp_path.name}/runs"
    storage = open_storage(root)
    mirror = RunMirror(storage, "rep/run1", local).start()
    for name in ("config.yaml", "status.json"):
        mirror.put(name)
    assert mirror.close(), mirror.error
    assert not any(key.endswith("history.jsonl") for key, _ in storage.list("rep/run1")), "parts only"
    uri = f"{root}/rep/run1"
    assert report.load(uri)["history"] == report.load(local)["history"]
    out = tmp_path / "remote.png"
    assert main(["report", uri, "--out", str(out)]) == 0, capsys.readouterr().err
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 30_000
    assert main(["report", f"{root}/rep/nothing", "--out", str(out)]) == 2
    assert "not a run" in capsys.readouterr().err
