"""The job's rendezvous key, kept where a restarted coordinator finds it and no mirror copies it.

Workers sign what they write to their group's store with it (actors/transport/comm.py). The coordinator keeps
it in `secret.key` (mode 0600) in the run folder and in Ray's KV store (a restart on another node),
never in the state file, which is mirrored to the run's storage; a restarted coordinator recalls the
one its live workers hold. When the coordinator exits at the end of the job, both copies go (`forget`).
"""
from __future__ import annotations

import os
from pathlib import Path

from actors.control.members import log
from actors.control.workers import WorkerGroup
from actors.runs import runfiles

SECRET_FILE = "secret.key"
"""The rendezvous key in the run folder (mode 0600; never mirrored to the storage)."""


class RendezvousKey:
    """Keeps and recalls the key of the run `name` (`<job>/<run id>`) in `run_dir` and Ray's KV store."""

    def __init__(self, run_dir: Path, group: WorkerGroup, name: str, signs: bool) -> None:
        self.run_dir, self.group, self.name, self.signs = run_dir, group, name, signs

    def keep(self, secret: bytes) -> None:
        """Store `secret` in the run folder and Ray's KV store (nothing when the job signs nothing)."""
        if not secret:
            return
        self._keep_file(secret)
        self.group.keep_secret(self.name, secret)

    def recall(self, saved: dict, current: bytes) -> bytes:
        """The key the live workers hold: the run folder's, else Ray's KV store's (a restart on another
        node), else an older run's state file's (`saved`); else `current`, with a warning."""
        try:
            return bytes.fromhex((self.run_dir / SECRET_FILE).read_text().strip())
        except (OSError, ValueError):
            pass
        kept = self.group.recall_secret(self.name) if self.signs else None
        if kept:
            self._keep_file(kept)
            return kept
        if saved.get("secret"):  # a state file written before the key moved out of it
            return bytes.fromhex(saved["secret"])
        if current:
            log.warning("restarted without the rendezvous key (no %s, nothing in Ray's KV store): the live workers "
                        "hold another one, and groups they form with new members will refuse it", SECRET_FILE)
        return current

    def forget(self) -> None:
        """The job ended for good: delete the run folder's copy and every secret of the run in Ray's KV
        store (the key and the storage credentials, actors/runs/credentials.py)."""
        (self.run_dir / SECRET_FILE).unlink(missing_ok=True)
        self.group.forget_secrets(self.name)

    def _keep_file(self, secret: bytes) -> None:
        runfiles.write_bytes_atomic(self.run_dir / SECRET_FILE, secret.hex().encode())
        os.chmod(self.run_dir / SECRET_FILE, 0o600)
