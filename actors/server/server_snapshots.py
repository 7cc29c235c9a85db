"""The parameter server's snapshots, stored by a thread of their own so that no RPC waits for the store.

Every `server.snapshot_every` versions, `ServerHost` (actors/server/server_host.py) hands the server's
state to a `SnapshotWriter`: `ServerCore.state_dict()`, whose tensors are copies taken under the host's
lock. The writer's thread serializes it with `torch.save` and stores it as a checkpoint
(actors/runs/checkpoints.py: the data, then its manifest, then retention's deletes). On an object store that
is an upload, a listing and deletes. The push whose version crossed the boundary answers at once.

The writer has one slot. A state handed over while another is being stored replaces any state that
waits, so a slow store costs snapshots, never a push's time or memory for a queue. A failed store is
logged and counted (`failures`, which the server's summary shows), and the next snapshot is its retry.
`wait` blocks, up to a timeout, until nothing waits and nothing is being stored (the server's `close`).
"""
from __future__ import annotations

import io
import logging
import threading

import torch

from actors.runs import checkpoints
from actors.runs.storage import Storage, first_line

log = logging.getLogger(__name__)


class SnapshotWriter:
    """Stores the newest state handed over as a checkpoint under `where` (storage, key), keeping `keep`."""

    def __init__(self, where: tuple[Storage, str], keep: int, run_id: str) -> None:
        self.where, self.keep, self.run_id = where, keep, run_id
        self._cond = threading.Condition()
        self._pending: tuple[int, dict] | None = None
        self._newest = -1
        """The newest version handed over (an older one that lost a race to the host's lock is dropped)."""
        self._busy = False
        self.failures = 0
        self.stored = -1
        """The version of the newest snapshot stored (-1: none yet)."""
        threading.Thread(target=self._run, daemon=True, name="server snapshots").start()

    def submit(self, version: int, state: dict) -> None:
        """Store `state` (of `version`) when the thread is free, unless a newer one comes first."""
        with self._cond:
            if version > self._newest:
                self._newest, self._pending = version, (version, state)
                self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """True once nothing waits and nothing is being stored; False after `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None)
                assert self._pending is not None
                (version, state), self._pending, self._busy = self._pending, None, True
            try:
                self._store(version, state)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _store(self, version: int, state: dict) -> None:
        try:
            buf = io.BytesIO()
            torch.save(state, buf)
            checkpoints.save(self.where, version, buf.getvalue(), self.keep, self.run_id)
            self.stored = version
        except Exception as err:  # noqa: BLE001 - counted and logged; the next snapshot is the retry
            self.failures += 1
            log.error("could not store the server's snapshot of version %d in %s: %s (the next snapshot tries again)",
                      version, self.where[0].location(self.where[1]), first_line(err))
