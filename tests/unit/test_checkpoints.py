"""Checkpoint files: atomic, verified, pruned, and the newest whole one found again."""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import torch

from actors.runs import checkpoints
from testkit.stores import HookedStore


def blob(step: int) -> bytes:
    buf = io.BytesIO()
    torch.save({"step": step, "w": torch.full((100,), float(step))}, buf)
    return buf.getvalue()


def data_of(run: Path, step: int) -> Path:
    """The data object a step's manifest names (`step-N-<random>.pt`)."""
    (data,) = (run / "checkpoints").glob(f"step-{step:08d}-*.pt")
    return data


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
    newest = data_of(run, 60)
    newest.write_bytes(newest.read_bytes()[:100])
    warnings = []
    ref = checkpoints.newest_valid(tmp_path / "job", warn=warnings.append)
    assert ref.step == 40
    assert len(warnings) == 1 and newest.name in warnings[0] and "bytes" in warnings[0]


def test_corrupted_bytes_of_same_length_are_caught(tmp_path):
    run = tmp_path / "job" / "r"
    checkpoints.save(run, 10, blob(10), keep=3)
    path = data_of(run, 10)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "sha256" in checkpoints.verify(run / "checkpoints" / "step-00000010.json")
    assert checkpoints.newest_valid(tmp_path / "job", warn=lambda _: None) is None


def test_keep_prunes_oldest_and_newest_run_wins_by_step(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoints.save(tmp_path / "job" / "r1", step, blob(step), keep=2)
    assert sorted(p.name[:13] for p in (tmp_path / "job" / "r1" / "checkpoints").glob("*.pt")) == [
        "step-00000030", "step-00000040"]
    checkpoints.save(tmp_path / "job" / "r2", 50, blob(50), keep=2)
    assert checkpoints.newest_valid(tmp_path / "job").run_id == "r2"


def test_data_without_manifest_never_counts(tmp_path):
    folder = tmp_path / "job" / "r" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "step-00000099.pt").write_bytes(blob(99))
    assert checkpoints.newest_valid(tmp_path / "job") is None


# ---------------------------------------------------------------- issue 47 item 7: what --resume picks and loads
def test_resume_takes_the_newest_runs_lineage_not_the_highest_step_of_any_run(tmp_path):
    """An older run reached step 60; a newer one, started fresh, reached step 20: `--resume` continues
    the newer run (its step 20), not the older run's higher step."""
    for step in (20, 40, 60):
        checkpoints.save(tmp_path / "job" / "20261101-100000-aaaa", step, blob(step), keep=3)
    for step in (10, 20):
        checkpoints.save(tmp_path / "job" / "20261102-100000-bbbb", step, blob(step), keep=3)
    ref = checkpoints.newest_valid(tmp_path / "job")
    assert (ref.run_id, ref.step) == ("20261102-100000-bbbb", 20), ref


def test_retention_orders_checkpoints_by_step_number_not_by_name(tmp_path):
    """Steps past 1e8 have 9 digits: by name `step-100000000` sorts before `step-99999999`, and `keep: 1`
    deleted the newest."""
    run = tmp_path / "job" / "r"
    checkpoints.save(run, 99_999_999, blob(1), keep=1)
    checkpoints.save(run, 100_000_000, blob(2), keep=1)
    ref = checkpoints.newest_valid(tmp_path / "job")
    assert ref is not None and ref.step == 100_000_000


class CountingStorage:
    """A storage that counts reads and can hand out other bytes on the second read of an object."""

    def __init__(self, inner, swap_on_second_read: bytes | None = None):
        self.inner, self.swap, self.reads = inner, swap_on_second_read, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, key):
        self.reads[key] = self.reads.get(key, 0) + 1
        data = self.inner.read(key)
        if key.endswith(".pt") and self.swap is not None and self.reads[key] >= 2:
            return self.swap
        return data


def test_what_is_loaded_is_what_was_verified_read_once(tmp_path):
    from actors.runs.storage import open_storage

    location = checkpoints.save(tmp_path / "job" / "r", 10, blob(10), keep=3)
    storage = CountingStorage(open_storage(str(tmp_path)), swap_on_second_read=b"not the verified bytes")
    data = checkpoints.read_verified(storage, location)
    assert data == blob(10), "the bytes loaded are not the bytes whose sha256 was checked"
    assert [n for k, n in storage.reads.items() if k.endswith(".pt")] == [1], storage.reads


def test_writing_a_step_again_never_breaks_its_committed_checkpoint(tmp_path):
    """A step saved again (a stop at a checkpoint step, a redo after a restore) whose upload dies between
    the data and the manifest: the committed checkpoint of that step stays whole (a data object's name
    is never reused; the manifest is the commit)."""
    from actors.runs.storage import open_storage

    run = tmp_path / "job" / "r"
    checkpoints.save(run, 10, blob(10), keep=1)

    def dies_before_the_manifest(key, data):
        if key.endswith(".json"):
            raise OSError("the process died here")
    try:
        checkpoints.save((HookedStore(open_storage(str(run)), dies_before_the_manifest), ""), 10,
                         b"a newer state of step 10", keep=1)
    except OSError:
        pass
    ref = checkpoints.newest_valid(tmp_path / "job", warn=lambda text: None)
    assert ref is not None and ref.step == 10, "the committed checkpoint of step 10 was destroyed"
    assert torch.load(io.BytesIO(Path(ref.location).read_bytes()), weights_only=True)["step"] == 10


def test_data_left_without_a_manifest_is_collected_by_the_next_save(tmp_path):
    folder = tmp_path / "job" / "r" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "step-00000005.pt").write_bytes(b"a crash between data and manifest left this")
    checkpoints.save(tmp_path / "job" / "r", 10, blob(10), keep=2)
    assert not (folder / "step-00000005.pt").exists()
    assert len(list(folder.glob("*.pt"))) == 1


def test_a_manifest_cannot_point_outside_its_folder(tmp_path):
    run = tmp_path / "job" / "r"
    location = checkpoints.save(run, 10, blob(10), keep=3)
    manifest = run / "checkpoints" / "step-00000010.json"
    info = json.loads(manifest.read_text())
    (tmp_path / "secret.pt").write_bytes(b"x")
    info.update(file="../../../secret.pt", bytes=1, sha256=hashlib.sha256(b"x").hexdigest())
    manifest.write_text(json.dumps(info))
    assert checkpoints.verify(manifest) is not None
    with pytest.raises(RuntimeError):
        checkpoints.read_verified(open_storage_of(tmp_path), location)


def open_storage_of(path):
    from actors.runs.storage import open_storage

    return open_storage(str(path))


def test_the_manifest_carries_the_workloads_fingerprint(tmp_path):
    checkpoints.save(tmp_path / "job" / "r", 10, blob(10), keep=3, fingerprint="abc123")
    ref = checkpoints.newest_valid(tmp_path / "job")
    assert ref.fingerprint == "abc123"
