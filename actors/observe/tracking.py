"""TensorBoard: the job's scalars, written by the coordinator alone, with the committed step as the
global step.

The coordinator is the one writer (never the workers), so a step is written once however many
members committed it. It writes what history takes as newest: loss, each evaluation metric
(`eval/<name>`), each step metric the workload's loss returns (`train/<name>`), world size,
membership epoch, steps per second over the last 5 s, and bytes (`bytes/sent`, cumulative, and
`bytes/per_step`). The per-member kinds (history per member) write
each member's under its slot (`loss/w0`, ...).

The coordinator's event loop only hands each record over; a thread of the writer's own builds the
events (tensorboardX's protobufs, 30-70 µs a scalar here) in batches, about once a second.

A step that comes again is redone: a restore from a checkpoint, a parameter server's rewind to its
snapshot, or a step superseded in a newer membership epoch. The steps from it on were lost, so the
writer starts a new event file with `purge_step` at it: TensorBoard discards what the files before
hold from that step on, and shows the redone values in their place.

A restarted coordinator's writer thread first finds where the dead writer stopped: the last record
its event files hold for each slot (a torn last record from the crash is ignored), found again in
history by its step and time. It writes what history holds after it (the dead writer's unflushed
tail, redos included), then the new records; a last record that history lacks (superseded before
history wrote it) is written again from its step on. So TensorBoard shows each step once, as history
has it last, across restarts, and reading the files costs the restarted coordinator's start nothing.
"""
from __future__ import annotations

import collections
import json
import logging
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
WINDOW_S = 5.0
FLUSH_EVERY_S = 1.0


def last_written(directory: Path, per_member: bool = False) -> dict[str, tuple[int, float]]:
    """(step, wall time) of the last record written for each slot ("" unless `per_member`), in the order
    TensorBoard reads the event files (by name). TFRecord framing: length, its CRC, the Event, its CRC;
    a short read ends a file."""
    from tensorboardX.proto import event_pb2

    last: dict[str, tuple[int, float]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        with open(path, "rb") as f:
            while True:
                header = f.read(12)
                if len(header) < 12:
                    break
                (length,) = struct.unpack("<Q", header[:8])
                data, crc = f.read(length), f.read(4)
                if len(data) < length or len(crc) < 4:
                    break
                event = event_pb2.Event.FromString(data)
                for value in event.summary.value:
                    last[value.tag.rsplit("/", 1)[-1] if per_member else ""] = (event.step, event.wall_time)
    return last


def tensorboard_dir(configured: str, run_dir: Path, job: str, run_id: str) -> Path:
    """`tracking.tensorboard`: a relative path is inside the run directory; an absolute one holds a
    folder per job and run (TensorBoard shows each run as its own curve)."""
    path = Path(configured).expanduser()
    return path / job / run_id if path.is_absolute() else run_dir / path


def _records(history: Path, size: int) -> Iterator[dict]:
    """History's records in its first `size` bytes (what it held when the writer started), line by line."""
    read = 0
    with open(history, "rb") as f:
        for line in f:
            read += len(line)
            if read > size:
                return
            try:
                yield json.loads(line)
            except ValueError:
                continue  # a torn last line


class TensorBoard:
    """A journal listener (actors/control/journal.py) writing TensorBoard event files from its thread."""

    def __init__(self, directory: Path, per_member: bool, incarnation: int = 0, history: Path | None = None) -> None:
        """`history`: the run's history file, whose records after the dead writer's last ones (a restart)
        the thread writes first (what it holds now: the records after that come from the journal)."""
        from tensorboardX import SummaryWriter  # only when asked for

        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.per_member, self.incarnation = directory, per_member, incarnation
        self._history = (history, history.stat().st_size) if history is not None and history.exists() else None
        self.caught_up = 0
        """How many records of history the thread wrote first (a restart: what the dead writer had not)."""
        self.newest: dict[str, int] = {}
        """Each slot's newest step written: a record at or below it is a redo."""
        self._writer_class = SummaryWriter
        self._files = 0
        self.writer = self._open()
        self._recent: dict[str, collections.deque] = {}
        self._bytes: dict[str, int] = {}
        self._pending: list[dict] = []
        self._cond = threading.Condition()
        self._closed = False
        self.error: BaseException | None = None
        """A failure of the writer's thread, raised to the next caller of `record` (the journal says it once)."""
        self._thread = threading.Thread(target=self._run, daemon=True, name="tensorboard writer")
        self._thread.start()

    def _open(self, purge_step: int | None = None) -> Any:
        """A writer on a new file. Its name sorts after the files before it (TensorBoard reads them in the
        order of their names, which start with the second they were made in)."""
        self._files += 1
        return self._writer_class(logdir=str(self.directory), max_queue=1000, flush_secs=120, purge_step=purge_step,
                                  filename_suffix=f".incarnation{self.incarnation}.{self._files:04d}")

    @classmethod
    def for_run(cls, configured: str, run_dir: Path, job: str, run_id: str, per_member: bool,
                incarnation: int) -> TensorBoard:
        """The writer of a run (`tracking.tensorboard`), caught up with its history (a restart: what the
        dead writer had not flushed)."""
        return cls(tensorboard_dir(configured, run_dir, job, run_id), per_member, incarnation,
                   history=run_dir / "history.jsonl")

    # ------------------------------------------------------------------ the caller's side
    def record(self, record: dict) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error
        with self._cond:
            self._pending.append(record)

    def event(self, event: Any) -> None:
        """Events are not scalars; the run report (actors/observe/report.py) draws them."""

    def close(self) -> None:
        """Write what is queued, then close the files."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            log.warning("TensorBoard: the writer's thread did not finish its last batch in 60 s")
            return
        self.writer.close()

    # ------------------------------------------------------------------ the writer's thread
    def _run(self) -> None:
        try:
            self._catch_up()
        except Exception as err:  # noqa: BLE001 - said at the next record; the new records are still written
            self.error = err
        closed = False
        while not closed:
            with self._cond:
                self._cond.wait_for(lambda: self._closed, timeout=FLUSH_EVERY_S)
                batch, self._pending, closed = self._pending, [], self._closed
            for record in batch:
                try:
                    self._write(record)
                except Exception as err:  # noqa: BLE001 - one bad record must not stop the writer
                    self.error = self.error or err
            if batch:
                self.writer.flush()

    def _catch_up(self) -> None:
        """Where the dead writer stopped, and history's records after it, ahead of the queue."""
        resume_after = last_written(self.directory, self.per_member)
        self.newest = {slot: step for slot, (step, _) in resume_after.items()}
        if self._history is not None:
            queued = self._after(resume_after, *self._history)
            with self._cond:
                self._pending[:0] = queued
            self.caught_up = len(queued)

    def _after(self, resume_after: dict[str, tuple[int, float]], history: Path, size: int) -> list[dict]:
        """History's records after each slot's last one written. A slot whose last record history lacks (the
        dead writer took a step that was then superseded, before history wrote it) from that step on."""
        found = {slot for slot, marker in map(self._marker, _records(history, size)) if resume_after.get(slot) == marker}
        waiting = dict(resume_after)
        queued = []
        for record in _records(history, size):
            slot, marker = self._marker(record)
            if slot in waiting:
                if slot in found and waiting[slot] == marker:
                    del waiting[slot]
                if slot in found or marker[0] < waiting[slot][0]:
                    continue
                del waiting[slot]
            queued.append(record)
        return queued

    def _marker(self, record: dict) -> tuple[str, tuple[int, float]]:
        return self._slot(record), (int(record["step"]), float(record["time"]))

    def _slot(self, record: dict) -> str:
        return record.get("slot", "") if self.per_member else ""

    def _purge(self, step: int) -> None:
        """Steps from `step` on are redone: a new file whose purge hides the lost ones, for every slot (a
        restore redoes every member's)."""
        self.writer.close()
        self.writer = self._open(purge_step=step)
        self.newest = {slot: min(newest, step - 1) for slot, newest in self.newest.items()}
        self._recent.clear()
        self._bytes.clear()

    def _write(self, record: dict) -> None:
        slot = self._slot(record)
        step, when = int(record["step"]), float(record["time"])
        if step <= self.newest.get(slot, 0):
            self._purge(step)
        self.newest[slot] = step
        tag = (lambda name: f"{name}/{slot}") if slot else (lambda name: name)
        add = self.writer.add_scalar
        if record.get("loss") is not None:
            add(tag("loss"), float(record["loss"]), step, walltime=when)
        for name, value in (record.get("metrics") or {}).items():
            if isinstance(value, (int, float)):
                add(tag(f"eval/{name}"), float(value), step, walltime=when)
        for name, value in (record.get("step_metrics") or {}).items():
            add(tag(f"train/{name}"), float(value), step, walltime=when)
        for name in ("world_size", "membership_epoch", "grad_norm", "skipped_updates"):
            if record.get(name) is not None:
                add(tag(name), float(record[name]), step, walltime=when)
        recent = self._recent.setdefault(slot, collections.deque())
        recent.append((when, step))
        while recent[0][0] < when - WINDOW_S:
            recent.popleft()
        if len(recent) >= 2 and recent[-1][0] > recent[0][0]:
            add(tag("steps_per_second"), (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0]), step,
                walltime=when)
        sent: int | None = record.get("bytes_sent")
        if sent is not None:
            add(tag("bytes/sent"), float(sent), step, walltime=when)
            before = self._bytes.get(slot)
            if before is not None and sent >= before:
                add(tag("bytes/per_step"), float(sent - before), step, walltime=when)
            self._bytes[slot] = sent
