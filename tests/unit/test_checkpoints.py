"""Checkpoint files: atomic, verified, pruned, and the newest whole one found again."""
from __future__ import annotations

import io

import torch

from actors import checkpoints


def blob(step: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"step": step, "w": torch.full((100,), float(step))}, buf)
    return buf.getvalue()


def test_save_verify_and_find_newest(tmp_path):
    run = tmp_path / "job" / "run-a"
    for step in (20, 40, 60):
        checkpoints.save(run, step, blob(step), keep=3)
    ref = checkpoints.newest_valid(tmp_path / "job")
    assert ref.step == 60 and ref.run_id == "run-a"
    assert torch.load(ref.path, weights_only=True)["step"] == 60
    assert not list(run.glob("checkpoints/.*")), "temporary files left behind"


def test_truncated_newest_is_skipped_with_a_warning(tmp_path):
    run = tmp_path / "job" / "run-a"
    for step in (20, 40, 60):
        checkpoints.save(run, step, blob(step), keep=3)
    newest = run / "checkpoints" / "step-00000060.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    warnings = []
    ref = checkpoints.newest_valid(tmp_path / "job", warn=warnings.append)
    assert ref.step == 40
    assert len(warnings) == 1 and "step-00000060.pt" in warnings[0] and "bytes" in warnings[0]


def test_corrupted_bytes_of_same_length_are_caught(tmp_path):
    run = tmp_path / "job" / "r"
    checkpoints.save(run, 10, blob(10), keep=3)
    path = run / "checkpoints" / "step-00000010.pt"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "sha256" in checkpoints.verify(path.with_suffix(".json"))
    assert checkpoints.newest_valid(tmp_path / "job", warn=lambda _: None) is None


def test_keep_prunes_oldest_and_newest_run_wins_by_step(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoints.save(tmp_path / "job" / "r1", step, blob(step), keep=2)
    assert sorted(p.name for p in (tmp_path / "job" / "r1" / "checkpoints").glob("*.pt")) == [
        "step-00000030.pt", "step-00000040.pt"]
    checkpoints.save(tmp_path / "job" / "r2", 50, blob(50), keep=2)
    assert checkpoints.newest_valid(tmp_path / "job").run_id == "r2"


def test_data_without_manifest_never_counts(tmp_path):
    folder = tmp_path / "job" / "r" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "step-00000099.pt").write_bytes(blob(99))
    assert checkpoints.newest_valid(tmp_path / "job") is None
