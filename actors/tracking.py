"""TensorBoard: the job's scalars, written by the coordinator alone, with the committed step as the
global step.

The coordinator is the one writer (never the workers), so a step is written once however many
members committed it. It writes what history takes as newest: loss, each evaluation metric
(`eval/<name>`), world size, membership epoch, steps per second over the last 5 s, and bytes
(`bytes/sent`, cumulative, and `bytes/per_step`). The per-member kinds (history per member) write
each member's under its slot (`loss/w0`, ...).

A restarted coordinator finds the steps already written in the directory's event files (read here,
record by record; a torn last record from the crash is ignored) and writes only the steps after
them: first the ones history holds that the dead incarnation had not flushed, then the new ones.
So TensorBoard shows each step once across restarts.
"""
from __future__ import annotations

import collections
import json
import struct
from pathlib import Path
from typing import Any

WINDOW_S = 5.0


def written_steps(directory: Path) -> dict[str, int]:
    """The newest step of each tag in the event files under `directory` (TFRecord framing: length,
    its CRC, the Event, its CRC; a short read ends a file)."""
    from tensorboardX.proto import event_pb2

    newest: dict[str, int] = {}
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
                    newest[value.tag] = max(newest.get(value.tag, 0), event.step)
    return newest


def tensorboard_dir(configured: str, run_dir: Path, job: str, run_id: str) -> Path:
    """`tracking.tensorboard`: a relative path is inside the run directory; an absolute one holds a
    folder per job and run (TensorBoard shows each run as its own curve)."""
    path = Path(configured).expanduser()
    return path / job / run_id if path.is_absolute() else run_dir / path


class TensorBoard:
    """A journal listener (actors/control/journal.py) writing TensorBoard event files."""

    def __init__(self, directory: Path, per_member: bool, incarnation: int = 0) -> None:
        from tensorboardX import SummaryWriter  # only when asked for

        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.per_member = directory, per_member
        self.written = written_steps(directory)
        self.writer = SummaryWriter(logdir=str(directory), max_queue=100, flush_secs=2,
                                    filename_suffix=f".incarnation{incarnation}")
        self._recent: dict[str, collections.deque] = {}
        self._bytes: dict[str, int] = {}

    @classmethod
    def for_run(cls, configured: str, run_dir: Path, job: str, run_id: str, per_member: bool,
                incarnation: int) -> TensorBoard:
        """The writer of a run (`tracking.tensorboard`), caught up with its history (a restart: what the
        dead writer had not flushed)."""
        board = cls(tensorboard_dir(configured, run_dir, job, run_id), per_member, incarnation)
        board.catch_up(run_dir / "history.jsonl")
        return board

    def catch_up(self, history: Path) -> int:
        """Steps history holds after the newest written ones (a restart: the dead writer's unflushed
        tail); returns how many were written."""
        if not history.exists():
            return 0
        count = 0
        with open(history, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn last line
                count += self._write(record)
        return count

    def record(self, record: dict) -> None:
        self._write(record)

    def event(self, event: Any) -> None:
        """Events are not scalars; the run report (orchestrator/report.py) draws them."""

    def _write(self, record: dict) -> int:
        slot = record.get("slot", "") if self.per_member else ""
        step, when = int(record["step"]), float(record["time"])
        loss_tag = f"loss/{slot}" if slot else "loss"
        if step <= self.written.get(loss_tag, 0):
            return 0  # written by this writer or by a dead incarnation's
        self.written[loss_tag] = step
        tag = (lambda name: f"{name}/{slot}") if slot else (lambda name: name)
        add = self.writer.add_scalar
        if record.get("loss") is not None:
            add(loss_tag, float(record["loss"]), step, walltime=when)
        for name, value in (record.get("metrics") or {}).items():
            if isinstance(value, (int, float)):
                add(tag(f"eval/{name}"), float(value), step, walltime=when)
        for name in ("world_size", "membership_epoch"):
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
        return 1

    def close(self) -> None:
        self.writer.close()
