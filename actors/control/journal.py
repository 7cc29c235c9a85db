"""The journal: everything a job run keeps in its run directory, and the progress status shows.

It owns the files (`events.jsonl`, `history.jsonl` through `actors/control/history.py`, the state file
`coordinator.json` written off the event loop, `faults_fired.json`, checkpoints, `status.json`),
the newest events in memory, and the progress read from history: the job's step, loss, evaluation
metrics and throughput over the last five seconds. It knows nothing of members or plans: the
coordinator hands it records, events and the state to save.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

from actors.control.history import History
from actors.control.tasks import Tasks
from actors.runs import checkpoints, runfiles
from actors.runs.mirror import RunMirror
from actors.runs.storage import Storage, first_line, open_storage, run_storage
from algorithms.rules.kinds import Reporter
from core.listener import JobListener
from core.schema import Event

log = logging.getLogger(__name__)
SAVED = "coordinator.json"
EVENTS_KEPT = 1000
"""Events kept in memory (events.jsonl keeps every one)."""
RESHAPES_SHOWN = 20
"""The newest reshapes in status (as with departed members)."""
THROUGHPUT_WINDOW_S = 5.0
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
    one still being stored (the restore waits for its store; `Journal.newest_checkpoint`)."""
    steps = [s for s in (stored[0] if stored else None, pending) if s is not None]
    return max(steps) if steps else None


class Journal:
    """One run directory: events, history, the state file, checkpoints, and the progress they show."""

    def __init__(self, run_dir: Path, keep_checkpoints: int, storage: Storage | None = None, run_key: str = "",
                 mirror: RunMirror | None = None, restarted: bool = False, store_delay_s: float = 0.0,
                 fingerprint: tuple[str, str] | None = None, store_fails_until: float = 0.0,
                 tasks: Tasks | None = None) -> None:
        """`storage` and `run_key`: where checkpoints go and `--resume` reads from (default: the run
        folder's grandparent, the local run root, and `<job>/<run id>`). `mirror`: the remote copy of
        the run folder (storage: an object store); a `restarted` coordinator first copies down what it
        holds that this node's folder lacks (Ray may restart it on another node). `store_delay_s`:
        each checkpoint's storing takes at least this long (`faults.checkpoint_store_s`, tests);
        `store_fails_until`: every storing fails until this time.time() (`faults.checkpoint_fail_s` after the
        job's start, over every coordinator incarnation).
        `fingerprint`: (fingerprint, description) of the workload, kept in each checkpoint's manifest.
        `tasks`: where its task that stores checkpoints runs (the coordinator's: actors/control/tasks.py)."""
        self.run_dir = run_dir
        self._tasks = tasks or Tasks()
        self.keep_checkpoints = keep_checkpoints
        self.store_delay_s = store_delay_s
        self.store_fails_until = store_fails_until
        self.fingerprint = fingerprint
        self._waiting: tuple[int, bytes, str, asyncio.Future] | None = None
        """The checkpoint waiting for the one being stored (a newer one replaces it)."""
        self._storer: asyncio.Task | None = None
        self._storing: int | None = None
        """The step of the checkpoint being stored now."""
        self.checkpoint_failures = 0
        """Tries to store a checkpoint that failed (each one an event)."""
        self._model_upload: tuple[threading.Thread, int] | None = None
        self.model_error = ""
        self.checkpoint_at = 0.0
        """When `checkpoint` was stored (time.time(); status: the last durable checkpoint's age)."""
        if storage is None:
            storage, run_key = run_storage(None, run_dir)
        self.storage, self.run_key, self.mirror = storage, run_key, mirror
        run_dir.mkdir(parents=True, exist_ok=True)
        self.hydrated: list[str] = mirror.hydrate() if mirror is not None and restarted else []
        """What a restart copied down from the remote copy (empty: this node's folder had it all)."""
        if mirror is not None:
            mirror.start()
        self.events: collections.deque[Event] = collections.deque(maxlen=EVENTS_KEPT)
        self.count = 0
        """The events this run has recorded, over every coordinator incarnation: an event's number is its
        line in events.jsonl (what `since` and `ElasticJob.wait_for` count by)."""
        self._events = runfiles.open_appended(run_dir / "events.jsonl")
        self._saver = runfiles.BackgroundWriter(run_dir / SAVED, written=lambda: self.put(SAVED))
        self._state_file_error = ""
        """The state file's last write failure that an event already reported."""
        self._mirror_error = ""
        self.fired_faults: set[int] = set(runfiles.read_json(run_dir / "faults_fired.json", []))
        self.history: History | None = None
        self._step = 0
        self._live: Callable[[], Iterable[str]] = lambda: ()
        self.loss: float | None = None
        self.metrics: dict = {}
        self.step_metrics: dict = {}
        """The workload's step metrics of the newest record that has them (`step_metrics`)."""
        self.recent: collections.deque[tuple[float, int, int]] = collections.deque()
        """(time, step, tokens so far) of the records of the last 5 s."""
        self._tokens = 0
        self._newest_at = 0.0
        self.checkpoint: tuple[int, str] | None = None
        """(step, path) of this run's newest checkpoint (what a loss of every member restarts from)."""
        self.skipped: set[tuple[int, int]] = set()
        """(step, sample id) of each bad sample a member skipped (`workload.on_bad_sample: skip`): a step
        that is redone skips its samples again, counted once."""
        self._step_times: TextIO | None = None
        self.listeners: list[JobListener] = []
        self._failed_listeners: set[int] = set()  # ids of the listeners whose failure was noted
        """Whatever follows the run as it is written (metrics, TensorBoard): each has `event(event)` and
        `record(record)`, called for every event and for every record history takes as its newest."""
        if self.hydrated:
            self.event("info", f"this node's run folder lacked the run's files: copied down from "
                               f"{storage.location(run_key)}: {', '.join(self.hydrated)}", copied=self.hydrated)

    # ------------------------------------------------------------------ events
    def event(self, kind: str, reason: str, state_from: str | None = None, state_to: str | None = None,
              **detail: Any) -> Event:
        event = Event(time=time.time(), kind=kind, reason=reason, state_from=state_from, state_to=state_to, detail=detail)
        self.events.append(event)
        self.count += 1
        self._events.write(json.dumps(event.to_dict()) + "\n")
        self._events.flush()
        self._tell("event", lambda listener: listener.event(event))
        return event

    def samples_skipped(self, slot: str, step: int, ids: list[int], reason: str) -> None:
        """A member trained its share of step `step` without these samples: counted, and an event."""
        self.skipped.update((step, i) for i in ids)
        self.event("samples_skipped", f"{slot} skipped {len(ids)} bad sample(s) at step {step}: ids "
                   f"{ids[:10]}{'...' if len(ids) > 10 else ''} ({reason})", slot=slot, step=step, ids=ids, cause=reason)

    def since(self, seen: int) -> tuple[list[dict], bool]:
        """The events numbered `seen` and later that are still in memory, and whether that is all of them
        (False: the oldest of them are only in events.jsonl now)."""
        first = self.count - len(self.events)
        kept = itertools.islice(self.events, max(0, seen - first), None)
        return [e.to_dict() for e in kept], seen >= first

    def recent_reshapes(self) -> tuple[Event, ...]:
        recent: list[Event] = []
        for event in reversed(self.events):
            if event.kind == "reshape":
                recent.append(event)
                if len(recent) == RESHAPES_SHOWN:
                    break
        return tuple(reversed(recent))

    # ------------------------------------------------------------------ history and progress
    @property
    def step(self) -> int:
        """The job's step: the newest committed (lockstep and server kinds), or the slowest live member's
        (each-member kinds: worked out when asked, since it goes over every member)."""
        if self.history is not None and self.history.reporter.each_member_reports:
            self._step = max(self._step, self.history.step(self._live()))
        return self._step

    def set_step(self, step: int) -> None:
        """The job's step from elsewhere than a newest record: an agreement that dropped a record, a restore
        or resume from a checkpoint, a server's restart, the end of the run."""
        self._step = step

    def open_history(self, reporter: Reporter, written_step: int, live: Callable[[], Iterable[str]] = lambda: ()) -> History:
        """`live()`: the live members (the each-member kinds' step is the slowest one's)."""
        self._live = live
        self.history = History(self.run_dir / "history.jsonl", reporter, written_step,
                               note=self._note)
        return self.history

    def _note(self, reason: str, detail: dict) -> None:
        self.event("info", reason, **detail)

    def offer(self, record: dict) -> bool:
        """A reported record into history; True when it is the job's newest (status moves on)."""
        if record.get("final"):  # evaluation after the last step: status only, not a history line
            self.metrics.update(record.get("metrics", {}))
            return False
        history = self.history
        assert history is not None, "records come only once the coordinator has opened history"
        newest = history.offer(record)
        if not history.reporter.each_member_reports:
            self._step = max(self._step, history.step())
        if newest is None:
            return False  # a step already in history, a stale report of a redone one, or one ahead of a gap
        if record.get("loss") is not None:
            self.loss = record["loss"]
        if record.get("metrics"):
            self.metrics = dict(record["metrics"])
        if record.get("step_metrics"):
            self.step_metrics = dict(record["step_metrics"])
        self._tokens += int(record.get("tokens") or 0)
        self.recent.append((record["time"], record["step"], self._tokens))
        self._newest_at = time.monotonic()
        while self.recent[0][0] <= record["time"] - THROUGHPUT_WINDOW_S:  # amortised O(1) per record
            self.recent.popleft()
        self._tell("record", lambda listener: listener.record(record))
        return True

    def step_times(self, times: dict[str, float]) -> None:
        """Each training member's step time (s) now, a line of `step_times.jsonl` (the run report's
        straggler heat map; the coordinator writes one a second)."""
        if not times:
            return
        if self._step_times is None:
            self._step_times = runfiles.open_appended(self.run_dir / "step_times.jsonl")
        self._step_times.write(json.dumps({"time": time.time(), "step_s": times}) + "\n")
        self._step_times.flush()

    def _tell(self, what: str, tell: Callable[[JobListener], None]) -> None:
        """Tell every listener (`core/listener.py`); a listener's first failure is one event."""
        for listener in self.listeners:
            try:
                tell(listener)
            except Exception as err:  # noqa: BLE001 - watching the job must never stop it
                if id(listener) not in self._failed_listeners:
                    self._failed_listeners.add(id(listener))
                    self.event("info", f"{type(listener).__name__} failed and goes on without that {what}: "
                                       f"{type(err).__name__}: {err}")

    def throughput(self) -> float | None:
        """Committed steps per second over the last 5 s."""
        return self._rate(1)

    def tokens_throughput(self) -> float | None:
        """Tokens per second over the last 5 s, all members together (None unless the workload counts
        tokens: `tokens_per_sample`)."""
        return self._rate(2) if self._tokens else None

    def _rate(self, field: int) -> float | None:
        if self.recent:  # the window ends now, not at the newest record: a stall empties it (on the records' clock)
            now = self.recent[-1][0] + time.monotonic() - self._newest_at
            while self.recent and self.recent[0][0] <= now - THROUGHPUT_WINDOW_S:
                self.recent.popleft()
        if len(self.recent) >= 2 and self.recent[-1][0] > self.recent[0][0]:
            return (self.recent[-1][field] - self.recent[0][field]) / (self.recent[-1][0] - self.recent[0][0])
        return None

    # ------------------------------------------------------------------ the state file
    def save_state(self, state: dict) -> int:
        """The state, as compact JSON (json's C encoder: about a millisecond for a thousand members),
        to the state file's writer thread (fsync never blocks the event loop). Serializing in that
        thread instead held the event loop longer: the thread holds the GIL for whole switch intervals.
        Returns the snapshot's number. A write failure is said once, as an event."""
        error = self._saver.error
        if error is not None and str(error) != self._state_file_error:
            self._state_file_error = str(error)
            self.event("info", f"the state file could not be written ({error}): a coordinator restart now would "
                               f"carry on from an older state; the newest state is written again at the next "
                               f"change", error=str(error))
        elif error is None:
            self._state_file_error = ""
        self.check_mirror()
        return self._saver.submit(runfiles.json_bytes(state, compact=True))

    def check_mirror(self) -> None:
        """A new failure of the run's remote copy becomes an event (once): called at each state save
        and from the coordinator's loop, so a quiet job hears it too."""
        failure = self.mirror.error if self.mirror is not None else ""
        if failure and failure != self._mirror_error:
            if self.mirror is not None and self.mirror.fenced:
                self.event("info", f"{failure}: a newer coordinator incarnation owns the run's copy on the storage",
                           error=failure)
            else:
                self.event("info", f"{failure}: the run's remote copy lags; a coordinator restarted on another node "
                                   f"would carry on from an older state", error=failure)
        self._mirror_error = failure

    def wait_saved(self, number: int, timeout: float) -> bool:
        """Until state snapshot `number` is on this node's disk and, with remote storage, in the store
        too (what must survive a restart persists before the action: a coordinator restarted on another
        node reads the store's copy). False past `timeout`."""
        deadline = time.monotonic() + timeout
        if not self._saver.wait(number, timeout):
            return False
        return self.mirror is None or self.mirror.flush(max(0.0, deadline - time.monotonic()))

    def load_state(self) -> dict:
        """A restarted coordinator's state file, with the events and the step history holds."""
        saved = runfiles.read_json(self.run_dir / SAVED)
        if saved is None:
            raise RuntimeError(f"restarted, but {self.run_dir / SAVED} is missing: cannot carry on")
        recorded = runfiles.read_jsonl(self.run_dir / "events.jsonl")
        self.events = collections.deque((Event(**e) for e in recorded), maxlen=EVENTS_KEPT)
        self.count = len(recorded)
        self.skipped = {(e["detail"]["step"], i) for e in recorded if e["kind"] == "samples_skipped"
                        for i in e["detail"]["ids"]}
        self.loss, self.metrics = saved["loss"], saved["metrics"]
        history = runfiles.read_jsonl(self.run_dir / "history.jsonl")
        self._step = history[-1]["step"] if history else 0
        self.step_metrics = dict(history[-1].get("step_metrics", {})) if history else {}
        return saved

    # ------------------------------------------------------------------ faults and checkpoints
    def fault_fired(self, index: int) -> None:
        self.fired_faults.add(index)
        self.write_json("faults_fired.json", self.fired())

    def fired(self) -> tuple[int, ...]:
        """The injected faults that fired in this run (a new worker skips them)."""
        return tuple(sorted(self.fired_faults))

    async def save_checkpoint(self, step: int, blob: bytes, note: str = "") -> str | None:
        """To the storage (an upload, for an object store), in a thread: the event loop goes on. One is
        stored at a time and one more waits: a newer checkpoint replaces the one waiting (an event says
        so; its caller gets None), so a slow or failing store holds at most two blobs, not a pile. A
        failure is an event (`checkpoint_failed`) and is tried again after each of
        `CHECKPOINT_RETRIES_S`; past them the checkpoint is given up (None), and the job trains on:
        status shows the last durable one."""
        loop = asyncio.get_running_loop()
        waiting = self._waiting
        if waiting is not None and not waiting[3].done():
            self.event("checkpoint_failed", f"checkpoint at step {waiting[0]} was not stored: the one at step {step} "
                                            f"replaced it while the store was busy", step=waiting[0], replaced_by=step,
                       error="replaced while waiting", attempt=0, retry=False, bytes=len(waiting[1]))
            waiting[3].set_result(None)
        done: asyncio.Future = loop.create_future()
        self._waiting = (step, blob, note, done)
        if self._storer is None or self._storer.done():
            self._storer = self._tasks.spawn(self._store_waiting())
        return await done

    def pending_checkpoint(self) -> int | None:
        """The step of the newest checkpoint being stored or waiting to be (None: none is)."""
        waiting = self._waiting[0] if self._waiting is not None and not self._waiting[3].done() else None
        steps = [s for s in (self._storing, waiting) if s is not None]
        return max(steps) if steps else None

    async def newest_checkpoint(self) -> tuple[int, str] | None:
        """The newest durable checkpoint once the stores under way have ended (stored or given up): a
        checkpoint still being stored when every member was lost is the one to restore from, not the one
        before it. (The death of every member is now known within a millisecond or two of the kill, often
        before the store of a checkpoint taken a few steps earlier has finished.)"""
        while self._storer is not None and not self._storer.done():
            await asyncio.shield(self._storer)
        return self.checkpoint

    async def _store_waiting(self) -> None:
        while self._waiting is not None:
            step, blob, note, done = self._waiting
            self._waiting = None
            if done.done():
                continue
            self._storing = step
            try:
                location = await self._store_checkpoint(step, blob, note)
            except Exception as err:  # noqa: BLE001 - the caller hears it; the next one is stored
                if not done.done():
                    done.set_exception(err)
                continue
            finally:
                self._storing = None
            if not done.done():
                done.set_result(location)

    async def _store_checkpoint(self, step: int, blob: bytes, note: str) -> str | None:
        def store() -> str:
            if self.store_delay_s:
                time.sleep(self.store_delay_s)
            if time.time() < self.store_fails_until:
                raise OSError(f"injected: storing checkpoints fails for {self.store_fails_until - time.time():.1f}s "
                              f"more (faults.checkpoint_fail_s)")
            fingerprint, workload = self.fingerprint or (None, "")
            return checkpoints.save((self.storage, self.run_key), step, blob, self.keep_checkpoints,
                                    self.run_key.rsplit("/", 1)[-1], fingerprint, workload)
        for attempt, pause in enumerate((*CHECKPOINT_RETRIES_S, None), start=1):
            started = time.monotonic()
            try:
                location = await asyncio.to_thread(store)
                break
            except Exception as err:  # noqa: BLE001 - any failure of the store is reported and tried again
                self.checkpoint_failures += 1
                error = f"{type(err).__name__}: {first_line(err)}"
                self.event("checkpoint_failed",
                           f"checkpoint at step {step} could not be stored (try {attempt}): {error}; "
                           + (f"trying again in {pause:g}s" if pause is not None else
                              "given up: the job trains on, and a restart would go back to "
                              + (f"step {self.checkpoint[0]}" if self.checkpoint else "the start")),
                           step=step, error=error, attempt=attempt, retry=pause is not None, bytes=len(blob))
                if pause is None:
                    return None
                await asyncio.sleep(pause)
        seconds = time.monotonic() - started
        self.event("checkpoint", note or f"checkpoint at step {step}", step=step, path=location, bytes=len(blob),
                   seconds=round(seconds, 3), attempts=attempt)
        if self.checkpoint is None or step >= self.checkpoint[0]:
            self.checkpoint, self.checkpoint_at = (step, location), time.time()
        return location

    def checkpoint_status(self) -> dict:
        """Status's `checkpoint`: the last durable one (step, time, where its data is) and the failed tries
        to store one."""
        out: dict = ({"step": self.checkpoint[0], "time": self.checkpoint_at, "path": str(self.checkpoint[1])}
                     if self.checkpoint else {})
        return dict(out, failures=self.checkpoint_failures) if out or self.checkpoint_failures else out

    async def read_checkpoint(self, location: str) -> bytes:
        """The checkpoint's bytes, once its manifest (size, sha256) checks out; raises with the problem."""
        location = str(location)
        storage = self.storage
        if not storage.remote and not storage.holds(location):  # a local file elsewhere
            storage = open_storage(str(Path(location).parent))
        return await asyncio.to_thread(checkpoints.read_verified, storage, location)

    def put(self, name: str) -> None:
        """The run folder's file `name` changed: its remote copy (if any) follows."""
        if self.mirror is not None:
            self.mirror.put(name)

    def write_json(self, name: str, obj: Any) -> None:
        """A run file written atomically here, and copied to the remote storage."""
        runfiles.write_json_atomic(self.run_dir / name, obj)
        self.put(name)

    def write_model(self, blob: bytes) -> None:
        """The final model: on this node's disk, and with remote storage uploaded straight to the store
        by a thread of its own (as checkpoints are; the mirror's whole files, status.json among them,
        do not wait behind it). `close` waits for it as long as its size needs."""
        runfiles.write_bytes_atomic(self.run_dir / "model.pt", blob)
        if self.mirror is None:
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

    def write_status(self, status: dict) -> None:
        self.write_json("status.json", status)

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()
        if self.history is not None:
            self.history.shut()
        self._events.close()
        if self._step_times is not None:
            self._step_times.close()
        self._saver.close()
        if self._model_upload is not None:
            thread, size = self._model_upload
            thread.join(model_upload_timeout(size))
            if thread.is_alive() or self.model_error:
                log.warning("the final model is not in the store: %s", self.model_error or "its upload timed out")
        if self.mirror is not None and not self.mirror.close():
            log.warning("the run's remote copy is not complete: %s", self.mirror.error or "the upload timed out")
