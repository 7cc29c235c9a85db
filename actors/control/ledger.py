"""The committed-step ledger: which history records are final, written exactly once per step.

A step's commit vote rides in its last all-reduce, and gloo can finish that all-reduce on some
ranks and fail it on others; so a record that rank 0 reports for step s may describe an update
that only some members (perhaps only members that then died) applied. The membership-epoch
start settles it: the members exchange their committed steps and the newest wins (see
actors/training/worker.py). The ledger therefore holds the newest record back as *tentative* and makes
it final when it is confirmed:

- a record of the next commit point from any epoch confirms the previous one (committing it
  needed every member of that epoch at the previous one). Commit points are steps for synchronous
  policies and rounds for periodic ones; a record's `prev` names the commit point before it
  (default: step - 1);
- an epoch agreement (epoch e agreed on step a) confirms a tentative record of an older epoch
  with step <= a and drops one with step > a (only departed members applied it; it is redone).
  Before it, rank 0 of epoch e offers every record it keeps since the plan's `history_step`,
  which fills in the steps a departed rank 0 committed but never reported;
- the end of the job confirms whatever is tentative (every member finished at that step).

Records that arrive ahead of a gap wait in `early` until the steps before them arrive. Every
member keeps only its newest records, so a coordinator that was down longer than that can never
fill the gap: at the next agreement (when every record anyone could send has been offered), or
once `MAX_EARLY` records wait, the gap is declared in `gaps` (for an event) and history goes on.

Pure bookkeeping, no Ray: each call returns the records that became final, in step order.
"""
from __future__ import annotations


class CommittedLedger:
    MAX_EARLY = 4096
    """Most records held ahead of a gap; beyond it the gap is declared (bounded memory)."""

    def __init__(self, written_step: int = 0) -> None:
        self.written_step = written_step
        """The newest step whose record is final (in history)."""
        self.tentative: dict | None = None
        self.dropped: list[dict] = []
        """Tentative records that an epoch agreement overruled (for the events)."""
        self.early: dict[int, dict] = {}
        """Records that arrived ahead of a gap, by their `prev`, until the records before them arrive."""
        self.gaps: list[tuple[int, int]] = []
        """(first, last) step ranges that history will never hold (for the events)."""

    @property
    def newest_step(self) -> int:
        """The newest step reported committed anywhere (tentative included)."""
        return self.tentative["step"] if self.tentative else self.written_step

    def offer(self, record: dict) -> list[dict]:
        """A record of a step that some member committed (rank 0's reports, or a catch-up)."""
        step = int(record["step"])
        if step <= self.written_step:
            return []
        if _prev(record) > self.newest_step:  # ahead of a gap (a restarted coordinator): wait for what precedes it
            self.early[_prev(record)] = record
            return self._close_gap() if len(self.early) > self.MAX_EARLY else []
        return self._next(record) + self._drain()

    def _drain(self) -> list[dict]:
        final: list[dict] = []
        while self.newest_step in self.early:
            final += self._next(self.early.pop(self.newest_step))
        return final

    def _next(self, record: dict) -> list[dict]:
        step, epoch = int(record["step"]), int(record.get("membership_epoch", 0))
        held = self.tentative
        if held is None or step > held["step"]:
            self.tentative = record
            return self._final(held)
        if step == held["step"] and epoch > int(held.get("membership_epoch", 0)):
            self.tentative = record  # the step was redone in a newer epoch: its record supersedes
        return []

    def agreed(self, epoch: int, step: int) -> list[dict]:
        """The members of `epoch` agreed that `step` is the newest committed step (its record, and
        any rank 0 never reported, were offered first: they travel with the state)."""
        for key, ahead in list(self.early.items()):
            if ahead["step"] > step and int(ahead.get("membership_epoch", 0)) < epoch:
                del self.early[key]  # applied only by members that left, like a dropped tentative record
        held = self.tentative
        final: list[dict] = []
        if held is not None and int(held.get("membership_epoch", 0)) < epoch:
            self.tentative = None
            if held["step"] > step:
                self.dropped.append(held)
            else:
                final = self._final(held)
        return final + self._close_gap()  # everything anyone keeps was offered: what is missing is gone

    def _close_gap(self) -> list[dict]:
        """Declare the steps before the oldest early record lost, and go on from that record."""
        if not self.early:
            return []
        first = min(self.early)  # the `prev` of the oldest record held: the gap ends there
        held, self.tentative = self.tentative, None
        final: list[dict] = []
        if held is not None:  # confirmed by the later record, unless a newer epoch redid its step
            later_epoch = int(self.early[first].get("membership_epoch", 0))
            final = self._final(held) if int(held.get("membership_epoch", 0)) >= later_epoch else []
        self.gaps.append((self.written_step + 1, first))
        self.written_step = first
        return final + self._drain()

    def write_up_to(self, step: int) -> None:
        """History holds every step up to `step` on another's word (a server's records, final at once; its
        restart from a snapshot; a resume from a checkpoint): the next record written follows it."""
        self.written_step = step

    def close(self) -> list[dict]:
        """The job ended with every member at the same step: the tentative record is final."""
        held, self.tentative = self.tentative, None
        return self._final(held)

    def _final(self, held: dict | None) -> list[dict]:
        if held is None:
            return []
        self.written_step = held["step"]
        return [held]


def _prev(record: dict) -> int:
    return int(record.get("prev", int(record["step"]) - 1))
