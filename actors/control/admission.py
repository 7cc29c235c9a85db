"""Admission: when workers that are ready (READY, started by the launcher) join a plan.

It owns the decision to admit and the restore that goes with it when every member was lost. Ready
workers are admitted together, by one plan, once the job would have at least `workers.min`
members; joiners started by one decision wait for each other (one pause for the survivors, not
several); while the survivors of a departure have not committed their first step without it,
joiners are held (`MembershipBook.held_departure`). A request to admit is coalesced: however
many workers become ready in one turn of the event loop, admission looks at the members once
(each look goes over every member, so one per joiner cost joiners x members at a large scale-up).
"""
from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from actors.control.book import ADMIT_HOLD_S, MembershipBook
from actors.control.checkpoint_store import CheckpointStore
from actors.control.journal import Journal
from actors.control.members import Member
from actors.control.tasks import Tasks
from actors.control.workers import WorkerGroup
from algorithms.rules.kinds import Kind
from algorithms.rules.membership import joiners_start_stateless
from algorithms.rules.supervision import JobState, MemberState

S = MemberState


class Admission:
    """Admits ready workers into plans; restores the first joiner from a checkpoint when asked."""

    def __init__(self, book: MembershipBook, journal: Journal, checkpoints: CheckpointStore, group: WorkerGroup,
                 kind: Kind, min_workers: int, state: Callable[[], JobState], may_start: Callable[[], bool],
                 history: Callable[[], Any], reshape: Callable[..., Any], start_run: Callable[[Member], None],
                 fail: Callable[[str, dict], Awaitable[None]], tasks: Tasks | None = None) -> None:
        """`checkpoints`: the run's (a restore reads one); `state()`: the job's state; `may_start()`: no stop
        decided and not ended; `history()`: the job's history; `reshape(members, reason, detector, decided,
        joiners=...)`: publish a reshape; `start_run(member)`: start an admitted member's run; `fail(reason,
        detail)`: end the job FAILED; `tasks`: where its tasks run (the coordinator's: actors/control/tasks.py)."""
        self.book, self.journal, self.checkpoints, self.group = book, journal, checkpoints, group
        self.kind, self.min_workers = kind, min_workers
        self._state, self._may_start, self._history = state, may_start, history
        self._reshape, self._start_run, self._fail = reshape, start_run, fail
        self.restore: tuple[int, str] | None = None
        """Set when every member was lost: the next admitted worker starts from this checkpoint (step, path),
        or from the newest stored once the stores under way have ended (a path of "": the checkpoint at
        that step was still being stored when the members were lost)."""
        self._tasks = tasks or Tasks()
        self._task: asyncio.Task | None = None
        self._wanted = False

    def restore_on_admit(self) -> None:
        """Every member was lost: the next admitted worker starts from the newest checkpoint, or from one
        being stored (the first, or one newer than the last stored), which the admission waits for."""
        pending = self.checkpoints.pending()
        self.restore = self.checkpoints.last if pending is None else (pending, "")

    async def request(self) -> None:
        """Look at admission soon, once for every worker that became ready in this turn of the loop."""
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = self._tasks.spawn(self._while_wanted())

    def request_later(self, delay: float) -> None:
        self._tasks.later(delay, self.request)

    async def _while_wanted(self) -> None:
        try:
            while self._wanted:
                self._wanted = False
                await asyncio.sleep(0)  # the joiners that became ready in this turn of the loop, together
                await self.admit()
        except Exception as err:  # noqa: BLE001 - a checkpoint that cannot be restored: the job cannot go on
            if not self._state().terminal:
                await self._fail(f"admitting workers failed: {type(err).__name__}: {err}",
                                 {"traceback": traceback.format_exc()})

    async def admit(self) -> None:
        """Admit ready workers with one plan, once there are at least `workers.min` members."""
        state, book = self._state(), self.book
        if book.plan is None or not state.active or not self._may_start():
            return
        ready, live = book.ready_to_admit(), book.live()
        if not ready or len(live) + len(ready) < self.min_workers:
            return
        if self.restore is not None and not live and book.slots_in(S.STARTING):
            return  # a restart from a checkpoint resumes at full width, as a fresh start does (admitted once all are up)
        decisions = {book.members[s].join_reason for s in ready}
        if state != JobState.PAUSED and any(book.members[s].join_reason in decisions for s in book.slots_in(S.STARTING)):
            return  # joiners of one decision are admitted together: one pause for the others, not several
        if book.held_departure(state):  # admitted when the survivors' epoch commits, or the hold ends
            self.request_later(ADMIT_HOLD_S)
            return
        reason, detector, decided = book.members[ready[0]].join_reason
        restore = None
        if self.restore is not None and not live:  # every member was lost: the first joiner starts from the checkpoint
            restore, self.restore = self.restore, None
            newest = await self.checkpoints.newest()  # one stored since the decision is newer
            if newest is not None and (newest[0] > restore[0] or not restore[1]):
                restore = newest
            elif not restore[1]:
                raise RuntimeError(f"every member was lost, and the checkpoint at step {restore[0]}, which was being "
                                   f"stored then, could not be stored (resume with --resume)")
            await self._restore_from(ready[0], *restore)
            # a scale down may have dropped joiners meanwhile: without the one restored, the next joiner restores
            if book.members[ready[0]].state != S.READY:
                self.restore = restore
                return
            ready = [s for s in ready if book.members[s].state == S.READY]
        if joiners_start_stateless(self.kind, self._history().step(live)):
            for slot in ready:  # until it loads the committed state (or commits in its epoch)
                book.members[slot].holds(slot == ready[0] and restore is not None)
        self._reshape(live + tuple(ready), reason, detector, decided, joiners=tuple(ready))
        for slot in ready:
            self._start_run(book.members[slot])

    async def _restore_from(self, slot: str, step: int, path: str) -> None:
        """Every member was lost: `slot`'s fresh worker loads the checkpoint at `step` (the others join
        it and receive the state at their epoch's start); history goes on from `step`, the steps after
        it that it already holds being redone (their new records follow the lost ones)."""
        try:
            data = await self.checkpoints.read(path)
        except RuntimeError as err:
            raise RuntimeError(f"every member was lost and the checkpoint at step {step} is not whole: {err} "
                               f"(resume with --resume from an older one)") from None
        await self.group.load_checkpoint(self.book.members[slot].handle, data, timeout=60)
        redone = self._history().restore(step)
        self.journal.set_step(step)
        lost = f"; steps {redone[0]}..{redone[1]} were committed by the lost members and are redone" if redone else ""
        self.journal.event("restore", f"every member was lost: {slot} starts from the checkpoint at step {step}{lost}",
                           step=step, path=path, slot=slot, redone=redone)
