"""The journal: everything a job run keeps in its run directory, and the progress status shows.

It owns the files (`events.jsonl`, `history.jsonl` through `actors/control/history.py`, the state file
`coordinator.json` written off the event loop, `faults_fired.json`, `status.json`; checkpoints and the
final model through its `CheckpointStore`, actors/control/checkpoint_store.py), the newest events in
memory, and the progress read from history: the job's step, loss, evaluation metrics and throughput
over the last five seconds. It knows nothing of members or plans: the coordinator hands it records,
events and the state to save.
"""
from __future__ import annotations

import collections
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

from actors.control.checkpoint_store import CheckpointStore
from actors.control.history import History
from actors.control.tasks import Tasks
from actors.plan import worker_tokens
from actors.runs import runfiles
from actors.runs.mirror import RunMirror
from actors.runs.storage import Storage, run_storage
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
RATE_RECORDS = 4
"""A rate's window holds at least this many records, however far apart (periodic rounds)."""


NEWEST_OF = ("step_metrics", "tensor_bytes")
"""Fields of a record that status shows as the newest record that has them says them: the workload's step
metrics, and what one worker holds of the training state with replica groups."""


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
        if storage is None:
            storage, run_key = run_storage(None, run_dir)
        self.storage, self.run_key, self.mirror = storage, run_key, mirror
        self.checkpoints = CheckpointStore(run_dir, storage, run_key, keep_checkpoints, self.event, mirror is not None,
                                           store_delay_s, fingerprint, store_fails_until, tasks)
        """The run's checkpoints and its final model (actors/control/checkpoint_store.py)."""
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
        self.newest_of: dict[str, dict] = {}
        """`NEWEST_OF`'s fields, as the newest record that has each says them."""
        self.recent: collections.deque[tuple[float, int, int, float, float]] = collections.deque()
        """(time, step, tokens so far) of the records of the last 5 s."""
        self._tokens = 0
        self._compute_s = 0.0
        """The compute seconds of the records that counted tokens (their step time less their waits)."""
        self._worker_tokens = 0.0
        """One worker's tokens in those records (`worker_tokens`)."""
        self.mfu: float | None = None
        """The newest record's model FLOPs utilization (a worker's compute: records carry it where the
        workload counts its FLOPs and the device's peak is known)."""
        self._newest_at = 0.0
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
        for key in NEWEST_OF:
            if record.get(key):
                self.newest_of[key] = dict(record[key])
        if record.get("mfu") is not None:
            self.mfu = float(record["mfu"])
        self._tokens += int(record.get("tokens") or 0)
        if record.get("tokens") and record.get("step_time") is not None:  # this record's compute: its step less its waits
            self._compute_s += max(float(record["step_time"]) - float(record.get("wait_s") or 0.0), 0.0)
            # one worker's tokens: a member's own record holds its own, rank 0's the global batch's
            self._worker_tokens += worker_tokens(record)
        self.recent.append((record["time"], record["step"], self._tokens, self._compute_s, self._worker_tokens))
        self._newest_at = time.monotonic()
        # the window: the last 5 s, and at least RATE_RECORDS records however far apart (a periodic round
        # of 8 s still shows a rate); amortised O(1) per record
        while len(self.recent) > RATE_RECORDS and self.recent[0][0] <= record["time"] - THROUGHPUT_WINDOW_S:
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
        """Tokens per second of wall clock (goodput) over the window, all members together (None unless
        the workload counts tokens: `tokens_per_sample`)."""
        return self._rate(2) if self._tokens else None

    def worker_tokens_per_compute_s(self) -> float | None:
        """One worker's tokens per second of its compute (its steps less their waits on the others) over
        the window: what a step itself achieves, beside the goodput, which counts every wait."""
        if not self._tokens or len(self.recent) < 2 or self._stalled():
            return None
        spent = self.recent[-1][3] - self.recent[0][3]
        return (self.recent[-1][4] - self.recent[0][4]) / spent if spent > 0 else None

    def _stalled(self) -> bool:
        """No record came for longer than the window, or than twice the window's gap between records: a
        stall (the rate then reads none, not the rate from before it)."""
        gap = (self.recent[-1][0] - self.recent[0][0]) / max(len(self.recent) - 1, 1)
        return time.monotonic() - self._newest_at > max(THROUGHPUT_WINDOW_S, 2 * gap)

    def _rate(self, field: int) -> float | None:
        if len(self.recent) < 2 or self._stalled():
            return None
        if self.recent[-1][0] > self.recent[0][0]:
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
        self.newest_of = {key: next((dict(r[key]) for r in reversed(history) if r.get(key)), {}) for key in NEWEST_OF}
        return saved

    # ------------------------------------------------------------------ faults and files
    def fault_fired(self, index: int) -> None:
        self.fired_faults.add(index)
        self.write_json("faults_fired.json", self.fired())

    def fired(self) -> tuple[int, ...]:
        """The injected faults that fired in this run (a new worker skips them)."""
        return tuple(sorted(self.fired_faults))

    def put(self, name: str) -> None:
        """The run folder's file `name` changed: its remote copy (if any) follows."""
        if self.mirror is not None:
            self.mirror.put(name)

    def write_json(self, name: str, obj: Any) -> None:
        """A run file written atomically here, and copied to the remote storage."""
        runfiles.write_json_atomic(self.run_dir / name, obj)
        self.put(name)

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
        self.checkpoints.close()
        if self.mirror is not None and not self.mirror.close():
            log.warning("the run's remote copy is not complete: %s", self.mirror.error or "the upload timed out")
