"""The lab's state and lock (orchestrator/lab.py): in a folder no one else can write, opened without
following links, and a lock that is held elsewhere fails in one line naming its holder instead of
hanging. No root and no `tc` needed: the folder is a temporary one (`lab.FOLDER`)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orchestrator import lab
from orchestrator.lab import LabUnavailable

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "lab"
    monkeypatch.setattr(lab, "FOLDER", path)
    return path


def take_and_release() -> None:
    with lab._locked():
        pass


def test_the_folder_is_made_private_when_missing(folder):
    take_and_release()
    assert stat.S_IMODE(folder.lstat().st_mode) == 0o700 and folder.is_dir()
    record = json.loads((folder / lab.LOCK).read_text())  # the holder's record, left for the next reader
    assert record["pid"] == os.getpid() and record["cmd"] and record["since"] > 0


def test_a_link_planted_at_the_lock_is_not_followed(folder, tmp_path):
    """Root creates the lock file: with a link at its name it used to create (or open) the link's target,
    anywhere a local user chose."""
    folder.mkdir(mode=0o700)
    absent, existing = tmp_path / "absent", tmp_path / "existing"
    existing.write_text("keep")
    existing.chmod(0o644)
    for target in (absent, existing):
        (folder / lab.LOCK).unlink(missing_ok=True)
        (folder / lab.LOCK).symlink_to(target)
        with pytest.raises(LabUnavailable, match="cannot open"):
            take_and_release()
    assert not absent.exists()
    assert existing.read_text() == "keep" and stat.S_IMODE(existing.stat().st_mode) == 0o644


def test_a_link_planted_at_the_state_is_neither_read_nor_written_through(folder, tmp_path):
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps({"network": "not the lab's", "fingerprint": "x"}))
    (folder / lab.STATE).symlink_to(victim)
    assert lab.read_state() is None
    lab._write_state({"network": None, "fingerprint": "f"})
    assert json.loads(victim.read_text())["network"] == "not the lab's"  # the link was replaced, not followed
    assert not (folder / lab.STATE).is_symlink() and lab.read_state()["fingerprint"] == "f"


@pytest.mark.parametrize("make,problem", [
    (lambda f, tmp: f.symlink_to(tmp), "a symbolic link"),
    (lambda f, tmp: f.mkdir(mode=0o777) or f.chmod(0o777), "writable by others"),
    (lambda f, tmp: f.write_text(""), "not a directory"),
], ids=["link", "others-may-write", "a-file"])
def test_a_folder_someone_else_could_change_is_refused(folder, tmp_path, make, problem):
    make(folder, tmp_path)
    with pytest.raises(LabUnavailable, match=problem) as err:
        take_and_release()
    assert "\n" not in str(err.value) and "ORCHESTRATOR_LAB_DIR" in str(err.value)


HOLD_PLAIN = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""

HOLD_AS_LAB = """
import sys
from pathlib import Path
from orchestrator import lab
lab.FOLDER = Path(sys.argv[1]).parent
with lab._locked():
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("holder", [HOLD_PLAIN, HOLD_AS_LAB], ids=["any-process-flock", "another-lab-process"])
def test_a_lock_held_elsewhere_times_out_naming_the_holder(folder, monkeypatch, holder):
    """A user's `flock` on the lock used to block root's `lab up`, `down` and the end of every run for
    ever. Now the wait ends after LOCK_TIMEOUT_S with the holder's pid and command line."""
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(lab, "LOCK_TIMEOUT_S", 0.5)
    child = subprocess.Popen([sys.executable, "-c", holder, str(folder / lab.LOCK)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert child.stdout.readline().strip() == "held"
        outcome: dict = {}

        def attempt() -> None:
            try:
                take_and_release()
                outcome["error"] = None
            except LabUnavailable as err:
                outcome["error"] = str(err)

        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        thread.join(timeout=30)  # the bound is on the test: without a timeout the wait never ends
        assert "error" in outcome, "the lab's lock waited on its holder without a timeout"
        message = outcome["error"]
        assert message and "\n" not in message, message
        assert f"the lab's lock is held by pid {child.pid} (" in message and "-c" in message, message
        assert " for " in message and str(folder / lab.LOCK) in message, message
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    take_and_release()  # once the holder has gone, the lock is free again
