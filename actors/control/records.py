"""Records accepted into history, and what each one closes.

Members (and the parameter server) report committed steps in batches; each record goes to the
journal, which writes history and moves the job's progress. A record that is the job's newest may
close what waited for it: a reshape whose epoch has now committed (its event, and the job back to
RUNNING), joiners held back for the survivors' first step, a `faults.scale` entry due at that step,
a turn of the policy trial, and the stop target (`stop.target`) once reached. An epoch's agreement on
its newest committed step settles which records are final.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from actors.control.admission import Admission
from actors.control.book import MembershipBook
from actors.control.history import History
from actors.control.job_state import JobStateMachine
from actors.control.journal import Journal
from actors.control.plans import Plans
from actors.control.tasks import Tasks
from actors.faults import CoordinatorFaults
from algorithms.rules.supervision import JobState, MemberState
from core.schema import JobConfig

S = MemberState


class Records:
    """Takes reported records into history and carries out what a newest record closes."""

    def __init__(self, cfg: JobConfig, journal: Journal, history: History, book: MembershipBook, job: JobStateMachine,
                 admission: Admission, plans: Plans, faults: CoordinatorFaults, tasks: Tasks,
                 stop: Callable[[str, str], Coroutine[Any, Any, None]], scale: Callable[[int], Coroutine[Any, Any, Any]],
                 end: Callable[[JobState, str], Awaitable[None]]) -> None:
        """`stop(kind, reason)`: a stop asked for (the supervisor's); `scale(count)`: a scale without waiting
        (`faults.scale`); `end(state, reason)`: end the job now."""
        self.cfg, self.journal, self.history, self.book, self.job = cfg, journal, history, book, job
        self.admission, self.plans, self.faults, self._tasks = admission, plans, faults, tasks
        self._stop, self._scale, self._end = stop, scale, end

    def accept(self, record: dict) -> None:
        newest = self.journal.offer(record)
        if not newest and not record.get("final"):
            return  # a step already in history, a stale report of a redone one, or one ahead of a gap
        if newest and self.faults.scales:
            for count in self.faults.due_scales(self.journal.step):
                self._tasks.spawn(self._scale_by_fault(count))
        if newest and self.book.pending:
            for detail in self.book.close_reshapes(record):
                self.journal.event("reshape", f"{detail['cause']}: {detail['old_members']} -> {detail['new_members']} "
                                   f"({detail['detector']}, {detail['duration_s']:.2f}s)", **detail)
            if not self.book.pending and self.job.state == JobState.RESHAPING:
                self.job.set_cause(None)  # a pause, if there was one, is over
                self.job.transition(JobState.RUNNING, f"membership epoch {record.get('membership_epoch', 0)} "
                                                      f"committed step {record['step']}")
            if self.book.slots_in(S.READY):  # joiners held back for the survivors' first step
                self._tasks.spawn(self.admission.request())
        if newest:
            self.plans.offer(record)
        target, metrics = self.cfg.stop.target, self.journal.metrics
        unknown = target.unknown_in(record["metrics"]) if target is not None and record.get("metrics") else None
        if unknown is not None and self.job.stop_kind is None:  # at the first evaluation: no later one would have it
            self._tasks.spawn(self._stop("FAILED", unknown))
            return
        if target is None or self.job.stop_kind is not None or target.metric not in metrics:
            return
        value = metrics[target.metric]
        if (value >= target.value) if target.mode == "max" else (value <= target.value):
            self._tasks.spawn(self._stop(
                "FINISHED", f"target reached: {target.metric} = {value:.4f} ({target.mode} {target.value})"))

    def report(self, records: tuple[dict, ...]) -> None:
        """A member's report: its records, with one flush of history for them all."""
        with self.history.batch():
            for record in records:
                try:
                    self.accept(record)
                except Exception as err:  # noqa: BLE001 - one bad record must not drop the rest
                    self.journal.event("info", f"could not record step {record.get('step')}: {type(err).__name__}: {err}")

    async def agreed(self, epoch: int, step: int, records: tuple[dict, ...]) -> None:
        """Rank 0 of `epoch`: its members agreed that `step` is the newest committed step; `records`
        are those it keeps after the plan's history step (what a departed rank 0 never reported)."""
        for record in records:
            self.accept(record)
        if step < self.history.written_step and epoch == self.book.epoch and not self.job.state.terminal:
            # Below a step history holds as final: none of the epoch's members holds the committed
            # state (joiners alone would start over). Never train on from there: end, resumable.
            await self._end(JobState.FAILED, f"the members of membership epoch {epoch} agreed on step {step}, below the "
                                             f"committed step {self.history.written_step}: none of them holds the "
                                             f"committed state (resume with --resume)")
            return
        self.history.agreed(epoch, step)
        self.journal.set_step(self.history.step())

    async def _scale_by_fault(self, count: int) -> None:
        try:
            await self._scale(count)
        except ValueError as err:  # the job ended or stops meanwhile: said, not raised into the loop
            self.journal.event("info", f"faults.scale to {count} not done: {err}")
