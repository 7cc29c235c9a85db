"""The job's history file: every commit point exactly once per reporter, in order.

Who reports depends on the policy's kind (algorithms/policies/base.py):
- `rank0` (synchronous, periodic): rank 0 reports each commit point; the `CommittedLedger` holds
  its newest record until the members' next commit or epoch agreement confirms it, and fills in
  what a departed rank 0 never reported.
- `each` (decentralized, background): every member reports its own records (`slot` set); a member's
  step commits locally, so its records are final at once; the job's step is the minimum over the
  live members' newest steps.
- `server` (parameter-server kinds): the server reports each applied version; final at once.
"""
from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from actors.control.ledger import CommittedLedger
from actors.runs import runfiles
from algorithms.rules.kinds import Reporter


class History:
    def __init__(self, path: Path, reporter: Reporter, written_step: int = 0,
                 note: Callable[[str, dict], None] = lambda reason, detail: None) -> None:
        """`note(reason, detail)` records an event (a gap, a dropped record)."""
        self.reporter = reporter
        self.ledger = CommittedLedger(written_step=written_step)
        self.member_steps: dict[str, int] = {}
        self._file = runfiles.open_appended(path)
        self._note = note
        self._batched = False

    @contextlib.contextmanager
    def batch(self):
        """One flush for every record written inside (a report carries a few hundred)."""
        self._batched = True
        try:
            yield
        finally:
            self._batched = False
            self._file.flush()

    def offer(self, record: dict) -> dict | None:
        """A reported record; returns it when it is the job's newest (for status), else None."""
        if self.reporter.each_member_reports:
            slot = record.get("slot", "")
            if record["step"] <= self.member_steps.get(slot, 0):
                return None
            self.member_steps[slot] = record["step"]
            self._write([record])
            return record
        if self.reporter.server_reports:
            if record["step"] <= self.ledger.written_step:
                return None
            self.ledger.write_up_to(record["step"])
            self._write([record])
            return record
        self._write(self.ledger.offer(record))
        return record if self.ledger.tentative is record else None

    def agreed(self, epoch: int, step: int, records: Iterable[dict] = ()) -> None:
        """Rank 0 of `epoch` says its members agreed that `step` is the newest committed step; the
        records it keeps since the plan's history step come along (what a departed rank 0 lacked)."""
        for record in records:
            self.offer(record)
        self._write(self.ledger.agreed(epoch, step))
        for held in self.ledger.dropped:
            self._note(f"step {held['step']} of membership epoch {held.get('membership_epoch')} was applied only by "
                       f"members that left; the members of epoch {epoch} agreed on step {step} and redo it",
                       {"step": held["step"], "membership_epoch": epoch})
        self.ledger.dropped.clear()

    def rewind(self, step: int) -> None:
        """The server kind's reporter restarted from its snapshot at version `step`: the versions after
        it are redone, and their new records are written (after the lost ones, which the event names).
        Versions up to `step` that history lacks were applied (the snapshot holds their result) but their
        records died with the server before it reported them: a note says so, and history goes on after
        `step`."""
        if self.reporter.server_reports:
            written = self.ledger.written_step
            if written < step:
                self._note(f"versions {written + 1}..{step} have no history record: the parameter server applied "
                           f"them (its snapshot at version {step} holds their result) but died before it reported "
                           f"them", {"first": written + 1, "last": step})
            self.ledger.write_up_to(step)

    def restore(self, step: int) -> list[int]:
        """Every member was lost and fresh ones start from the checkpoint at `step`: the steps after it
        are redone, and their new records are written after the ones history holds (which stay, lost).
        Returns [first, last] of the steps history holds that are redone ([] when none)."""
        if self.reporter.rank0_reports:  # the checkpoint proves every step up to it committed: a record held back is final
            self._write(self.ledger.agreed(sys.maxsize, step))
            self.ledger.dropped.clear()
        written = max([self.ledger.written_step, *self.member_steps.values()])
        if written < step:
            self._note(f"steps {written + 1}..{step} have no history record: the lost members committed them but "
                       f"never reported them (the checkpoint at step {step} holds their result)",
                       {"first": written + 1, "last": step})
        self.ledger = CommittedLedger(written_step=step)
        self.member_steps = {slot: min(s, step) for slot, s in self.member_steps.items()}
        return [step + 1, written] if written > step else []

    def resume_at(self, step: int) -> None:
        """`--resume` from a checkpoint at `step`: history goes on after it."""
        self.ledger.write_up_to(step)

    def close(self) -> None:
        """The job ended with every member at one step: whatever is held is final."""
        self._write(self.ledger.close())

    def step(self, live: Iterable[str] = ()) -> int:
        """The job's step: the newest committed (lockstep and server kinds), or the slowest live
        member's (each-member kinds)."""
        if self.reporter.each_member_reports:
            steps = [self.member_steps.get(s, 0) for s in live]
            return min(steps) if steps else max(self.member_steps.values(), default=0)
        return self.ledger.newest_step

    @property
    def written_step(self) -> int:
        return self.ledger.written_step

    def _write(self, records: list[dict]) -> None:
        for record in records:
            self._file.write(json.dumps(record) + "\n")
        if records and not self._batched:
            self._file.flush()
        for first, last in self.ledger.gaps:
            self._note(f"history lacks steps {first}..{last}: they were committed while no coordinator received "
                       f"reports, and the members keep only their newest records", {"first_step": first, "last_step": last})
        self.ledger.gaps.clear()

    def shut(self) -> None:
        self._file.close()


def read_steps(records: Iterable[dict]) -> int:
    """The newest step in a history file's records (a restarted coordinator starts after it)."""
    return max((r.get("step", 0) for r in records), default=0)
