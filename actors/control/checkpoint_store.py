"""The run's checkpoints in its storage, and the final model.

One checkpoint is stored at a time, in a thread, and one more waits (a newer one replaces it), so a
slow or failing store holds at most two blobs; a store that fails is tried again after each of
`CHECKPOINT_RETRIES_S` and then given up, each try an event (`checkpoint_failed`), and the job trains
on. It knows the newest durable checkpoint (what a loss of every member restarts from) and the one
being stored; it reads a checkpoint back once its manifest checks out; and it writes the final model to
the run folder and, with remote storage, uploads it by a thread of its own that `close` waits for.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.control.tasks import Tasks
from actors.runs import checkpoints, runfiles
from actors.runs.storage import Storage, first_line, open_storage

log = logging.getLogger(__name__)
MODEL_UPLOAD_BASE_S = 60.0
MODEL_UPLOAD_MIN_RATE = 10e6
"""The final model's upload is waited for MODEL_UPLOAD_BASE_S plus its size at this many bytes a second."""
CHECKPOINT_RETRIES_S = (1.0, 2.0, 4.0, 8.0)
"""A checkpoint whose storing fails is tried again after each of these pauses, then given up (an event
each time: `checkpoint_failed`); the job trains on either way."""


def model_upload_timeout(size: int) -> float:
    """How long the end of a run waits for the final model's upload: scaled to its size."""
    return MODEL_UPLOAD_BASE_S + size / MODEL_UPLOAD_MIN_RATE


def restorable_step(stored: tuple[int, str] | None, pending: int | None) -> int | None:
    """The step a loss of every member restarts from: the newest stored checkpoint's, or that of a newer
    one still being stored (the restore waits for its store; `CheckpointStore.newest`)."""
    steps = [s for s in (stored[0] if stored else None, pending) if s is not None]
    return max(steps) if steps else None


class CheckpointStore:
    """Stores checkpoints (one at a time, one waiting), reads them back, and keeps the final model."""

    def __init__(self, run_dir: Path, storage: Storage, run_key: str, keep: int, event: Callable[..., Any],
                 mirrored: bool = False, store_delay_s: float = 0.0, fingerprint: tuple[str, str] | None = None,
                 store_fails_until: float = 0.0, tasks: Tasks | None = None) -> None:
        """`storage` and `run_key`: where checkpoints go and `--resume` reads from; `keep`: how many are kept;
        `event(kind, reason, **detail)`: the journal's; `mirrored`: the run folder has a remote copy (the final
        model is uploaded too); `store_delay_s`: each storing takes at least this long
        (`faults.checkpoint_store_s`, tests); `store_fails_until`: every storing fails until this time.time()
        (`faults.checkpoint_fail_s`); `fingerprint`: (fingerprint, description) of the workload, kept in each
        checkpoint's manifest; `tasks`: where its task that stores checkpoints runs."""
        self.run_dir, self.storage, self.run_key, self.keep = run_dir, storage, run_key, keep
        self._event, self.mirrored, self._tasks = event, mirrored, tasks or Tasks()
        self.store_delay_s = store_delay_s
        self.store_fails_until = store_fails_until
        self.fingerprint = fingerprint
        self._waiting: tuple[int, bytes, str, asyncio.Future] | None = None
        """The checkpoint waiting for the one being stored (a newer one replaces it)."""
        self._storer: asyncio.Task | None = None
        self._storing: int | None = None
        """The step of the checkpoint being stored now."""
        self.failures = 0
        """Tries to store a checkpoint that failed (each one an event)."""
        self.last: tuple[int, str] | None = None
        """(step, path) of this run's newest durable checkpoint (what a loss of every member restarts from)."""
        self.last_at = 0.0
        """When `last` was stored (time.time(); status: the last durable checkpoint's age)."""
        self._model_upload: tuple[threading.Thread, int] | None = None
        self.model_error = ""

    def restorable(self) -> int | None:
        """The step a loss of every member restarts from now (`restorable_step`)."""
        return restorable_step(self.last, self.pending())

    async def save(self, step: int, blob: bytes, note: str = "") -> str | None:
        """To the storage (an upload, for an object store), in a thread: the event loop goes on. One is
        stored at a time and one more waits: a newer checkpoint replaces the one waiting (an event says
        so; its caller gets None), so a slow or failing store holds at most two blobs, not a pile. A
        failure is an event (`checkpoint_failed`) and is tried again after each of
        `CHECKPOINT_RETRIES_S`; past them the checkpoint is given up (None), and the job trains on:
        status shows the last durable one."""
        loop = asyncio.get_running_loop()
        waiting = self._waiting
        if waiting is not None and not waiting[3].done():
            self._event("checkpoint_failed", f"checkpoint at step {waiting[0]} was not stored: the one at step {step} "
                                             f"replaced it while the store was busy", step=waiting[0], replaced_by=step,
                        error="replaced while waiting", attempt=0, retry=False, bytes=len(waiting[1]))
            waiting[3].set_result(None)
        done: asyncio.Future = loop.create_future()
        self._waiting = (step, blob, note, done)
        if self._storer is None or self._storer.done():
            self._storer = self._tasks.spawn(self._store_waiting())
        return await done

    def pending(self) -> int | None:
        """The step of the newest checkpoint being stored or waiting to be (None: none is)."""
        waiting = self._waiting[0] if self._waiting is not None and not self._waiting[3].done() else None
        steps = [s for s in (self._storing, waiting) if s is not None]
        return max(steps) if steps else None

    async def newest(self) -> tuple[int, str] | None:
        """The newest durable checkpoint once the stores under way have ended (stored or given up): a
        checkpoint still being stored when every member was lost is the one to restore from, not the one
        before it. (The death of every member is now known within a millisecond or two of the kill, often
        before the store of a checkpoint taken a few steps earlier has finished.)"""
        while self._storer is not None and not self._storer.done():
            await asyncio.shield(self._storer)
        return self.last

    async def _store_waiting(self) -> None:
        while self._waiting is not None:
            step, blob, note, done = self._waiting
            self._waiting = None
            if done.done():
                continue
            self._storing = step
            try:
                location = await self._store(step, blob, note)
            except Exception as err:  # noqa: BLE001 - the caller hears it; the next one is stored
                if not done.done():
                    done.set_exception(err)
                continue
            finally:
                self._storing = None
            if not done.done():
                done.set_result(location)

    async def _store(self, step: int, blob: bytes, note: str) -> str | None:
        def store() -> str:
            if self.store_delay_s:
                time.sleep(self.store_delay_s)
            if time.time() < self.store_fails_until:
                raise OSError(f"injected: storing checkpoints fails for {self.store_fails_until - time.time():.1f}s "
                              f"more (faults.checkpoint_fail_s)")
            fingerprint, workload = self.fingerprint or (None, "")
            return checkpoints.save((self.storage, self.run_key), step, blob, self.keep,
                                    self.run_key.rsplit("/", 1)[-1], fingerprint, workload)
        for attempt, pause in enumerate((*CHECKPOINT_RETRIES_S, None), start=1):
            started = time.monotonic()
            try:
                location = await asyncio.to_thread(store)
                break
            except Exception as err:  # noqa: BLE001 - any failure of the store is reported and tried again
                self.failures += 1
                error = f"{type(err).__name__}: {first_line(err)}"
                self._event("checkpoint_failed",
                            f"checkpoint at step {step} could not be stored (try {attempt}): {error}; "
                            + (f"trying again in {pause:g}s" if pause is not None else
                               "given up: the job trains on, and a restart would go back to "
                               + (f"step {self.last[0]}" if self.last else "the start")),
                            step=step, error=error, attempt=attempt, retry=pause is not None, bytes=len(blob))
                if pause is None:
                    return None
                await asyncio.sleep(pause)
        seconds = time.monotonic() - started
        self._event("checkpoint", note or f"checkpoint at step {step}", step=step, path=location, bytes=len(blob),
                    seconds=round(seconds, 3), attempts=attempt)
        if self.last is None or step >= self.last[0]:
            self.last, self.last_at = (step, location), time.time()
        return location

    def status(self) -> dict:
        """Status's `checkpoint`: the last durable one (step, time, where its data is) and the failed tries
        to store one."""
        out: dict = ({"step": self.last[0], "time": self.last_at, "path": str(self.last[1])}
                     if self.last else {})
        return dict(out, failures=self.failures) if out or self.failures else out

    async def read(self, location: str) -> bytes:
        """The checkpoint's bytes, once its manifest (size, sha256) checks out; raises with the problem."""
        location = str(location)
        storage = self.storage
        if not storage.remote and not storage.holds(location):  # a local file elsewhere
            storage = open_storage(str(Path(location).parent))
        return await asyncio.to_thread(checkpoints.read_verified, storage, location)

    def write_model(self, blob: bytes) -> None:
        """The final model: on this node's disk, and with remote storage uploaded straight to the store
        by a thread of its own (as checkpoints are; the mirror's whole files, status.json among them,
        do not wait behind it). `close` waits for it as long as its size needs."""
        runfiles.write_bytes_atomic(self.run_dir / "model.pt", blob)
        if not self.mirrored:
            return
        key = f"{self.run_key}/model.pt"

        def upload() -> None:
            for attempt, pause in enumerate((*CHECKPOINT_RETRIES_S[:2], None), start=1):
                try:
                    self.storage.write(key, blob)
                    return
                except Exception as err:  # noqa: BLE001 - reported, tried again
                    log.warning("the final model could not be uploaded to %s (try %d): %s",
                                self.storage.location(key), attempt, first_line(err))
                    if pause is None:
                        self.model_error = f"{type(err).__name__}: {first_line(err)}"
                        return
                    time.sleep(pause)
        self._model_upload = (threading.Thread(target=upload, name="model upload", daemon=True), len(blob))
        self._model_upload[0].start()

    def close(self) -> None:
        """Waits for the final model's upload as long as its size needs."""
        if self._model_upload is not None:
            thread, size = self._model_upload
            thread.join(model_upload_timeout(size))
            if thread.is_alive() or self.model_error:
                log.warning("the final model is not in the store: %s", self.model_error or "its upload timed out")
