"""The coordinator's state file: written by a thread of its own, so that a slow fsync never holds
up the coordinator's event loop (the survivors of a death wait on it), newest snapshot wins."""
from __future__ import annotations

import json
import os
import threading

import pytest

from actors.runs import runfiles


def test_a_slow_fsync_does_not_block_submit_and_snapshots_coalesce(tmp_path, monkeypatch):
    gate = threading.Event()
    real_fsync = os.fsync
    syncs = []

    def slow_fsync(fd):  # a disk busy with a checkpoint: fsync waits until the test lets it go
        syncs.append(fd)
        gate.wait(120)
        real_fsync(fd)
    monkeypatch.setattr(runfiles.os, "fsync", slow_fsync)
    writer = runfiles.BackgroundWriter(tmp_path / "state.json")
    numbers: list[int] = []
    # the 50 submits end while fsync is held (up to 120 s): a submit that waited for the disk would not
    submitter = threading.Thread(target=lambda: numbers.extend(writer.submit(runfiles.json_bytes({"n": n}))
                                                               for n in range(1, 51)))
    submitter.start()
    submitter.join(30)
    assert not submitter.is_alive(), "submit waited for the disk"
    assert numbers == list(range(1, 51))
    assert not writer.wait(50, timeout=0.05), "nothing is on disk while fsync is held"
    gate.set()
    assert writer.wait(50, timeout=5)
    assert json.loads((tmp_path / "state.json").read_text()) == {"n": 50}
    assert len(syncs) <= 2 * 2, "snapshots that arrived during a write were coalesced (2 fsyncs a write)"
    writer.close()


def test_close_writes_what_is_pending_and_a_failed_write_is_reported_not_raised_at_the_next_submit(tmp_path, monkeypatch):
    """A failed write of the state file is the writer's to report (`error`, `wait()` False), never an
    exception out of the next, unrelated submit: in the coordinator that submit follows plans already
    sent (an exception there failed the job) or a terminal transition (it skipped status.json)."""
    writer = runfiles.BackgroundWriter(tmp_path / "state.json")
    writer.submit(runfiles.json_bytes({"n": 1}))
    writer.close()
    assert json.loads((tmp_path / "state.json").read_text()) == {"n": 1}
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(b"{}")

    broken = runfiles.BackgroundWriter(tmp_path / "state.json")

    def no_space(path, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(runfiles, "write_bytes_atomic", no_space)
    number = broken.submit(runfiles.json_bytes({"n": 2}))
    assert not broken.wait(number, timeout=5), "a failed write is not reported as written"
    assert "No space left" in str(broken.error)
    broken.submit(runfiles.json_bytes({"n": 3}))  # no exception: still queued, written when the disk has room
    assert not broken.wait(timeout=5) and broken.error is not None
    monkeypatch.undo()
    broken.submit(runfiles.json_bytes({"n": 4}))
    assert broken.wait(timeout=5), "the next write, once the disk has room, lands"
    assert json.loads((tmp_path / "state.json").read_text()) == {"n": 4} and broken.error is None
    broken.close()
