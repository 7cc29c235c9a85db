"""Plans: what the coordinator decides about the membership, and publishes.

It publishes each plan (through the publisher, which hands it out), opens a reshape for each change
of the membership, converges on the target count (workers started, joiners dropped, members retired
by a plan), re-forms a group whose collective failed with every member alive, scales the job to a
count a user asked for, and runs `sync.auto`'s online trial (actors/control/trial.py), whose switches
are plans too. Reshapes and convergence take one lock: one decision about the membership at a time.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from actors.control.book import Convergence, MembershipBook
from actors.control.feed import Feed
from actors.control.history import History
from actors.control.job_state import JobStateMachine
from actors.control.publisher import Publisher
from actors.control.spares import SparePool
from actors.control.tasks import Tasks
from actors.control.trial import Trial
from actors.control.workers import WorkerGroup
from actors.plan import Plan
from algorithms.rules.membership import share_refusal
from algorithms.rules.supervision import JobState, MemberState
from core.schema import JobConfig

S = MemberState
SCALE_WAIT_S = 240.0
"""The longest `scale` waits for its joiners (a driver's call waits 300 s)."""


class Plans:
    """Publishes plans and reshapes; converges on the target count; re-forms; scales; the trial's switches."""

    def __init__(self, cfg: JobConfig, book: MembershipBook, publisher: Publisher, job: JobStateMachine,
                 history: History, feed: Feed, spares: SparePool, group: WorkerGroup, note: Callable[..., Any],
                 spawn: Callable[[list[str], str, str], None], persist: Callable[[], int], tasks: Tasks,
                 trial: dict | None = None) -> None:
        """`note(kind, reason, **detail)`: the journal's event; `spawn(slots, reason, detector)`: start a worker
        in each slot (the launcher's); `persist()`: save the coordinator's state; `trial`: the config's
        `policy_trial` when this incarnation runs the trial (None: no trial)."""
        self.cfg, self.book, self.publisher, self.job, self.history = cfg, book, publisher, job, history
        self.feed, self.spares, self.group, self._note = feed, spares, group, note
        self._spawn, self._persist, self._tasks = spawn, persist, tasks
        self._lock: asyncio.Lock | None = None  # made on the event loop (start)
        self._last_reform = 0.0
        self.trial = Trial(trial, self.switch_policy, note, self._can_switch) if trial else None
        """`sync.auto`'s online trial, on the first incarnation only."""

    def start(self) -> None:
        self._lock = asyncio.Lock()

    def _can_switch(self) -> bool:
        return not self.book.pending and self.job.stop_kind is None and self.job.state == JobState.RUNNING

    # ------------------------------------------------------------------ plans
    def publish(self, members: tuple[str, ...], reason: str, new_epoch: bool = False, aborts: bool = False) -> Plan:
        plan = self.publisher.publish(members, reason, self.history.written_step, new_epoch, aborts)
        self.feed.changed()  # a scale waits for its joiners' plan
        if self.trial is not None:
            self.trial.membership(plan.nodes)  # a node joining or leaving runs the trial again
        return plan

    def reshape(self, members: tuple[str, ...], reason: str, detector: str, detected_at: float,
                new_epoch: bool = False, joiners: tuple[str, ...] = (), leavers: tuple[str, ...] = (), *,
                aborts: bool = False) -> Plan:
        """Publish `members` as the next plan (a reshape); with `aborts`, its receipt also aborts the current
        epoch (the survivors' plan after a death: one call to each, not an abort and then a plan)."""
        if self.book.plan is None:
            raise RuntimeError("a reshape needs a membership to reshape: none was published")
        old = self.book.plan.members
        if self.job.state in (JobState.RUNNING, JobState.PAUSED):
            self.job.transition(JobState.RESHAPING, reason, persist=False)  # the publication below saves both
        plan = self.publish(members, reason, new_epoch=new_epoch, aborts=aborts)
        self.book.open_reshape(plan, old, reason, detector, detected_at, joiners, leavers)
        return plan

    def reform(self, reason: str) -> None:
        """Publish the live membership again as a new epoch, after aborting the current one: members
        whose group failed (to form, or in a collective, with every member still alive) start over
        and settle any split commit at the epoch start."""
        if time.monotonic() - self._last_reform < self.cfg.comm.timeout_s:
            return
        self._last_reform = time.monotonic()
        live = self.book.live()
        if live and not any(self.book.members[s].holds_state for s in live):
            return  # joiners alone cannot form an epoch: the finish or failure of the state's holders decides
        if live:
            self.reshape(live, reason, "collective failure", time.time(), new_epoch=True, aborts=True)

    # ------------------------------------------------------------------ the target count
    async def converge(self, reason: str, detector: str) -> Convergence | None:
        """Start workers, drop joiners or retire members until the membership matches the target count
        (slots permitting); what was decided, or None when the job takes no change now (stopping, ended)."""
        lock = self._lock
        if lock is None:
            raise RuntimeError("the coordinator converges only once started")
        async with lock:
            if not self.job.state.active or self.job.stop_kind is not None:
                return None
            done = self.book.converge()
            if done.missing > len(done.start):
                self._note("info", f"{reason}: {done.missing - len(done.start)} worker(s) short, no free slot "
                                   f"(retired: {', '.join(sorted(self.book.retired)) or 'none'})")
            if done.start:
                self._spawn(list(done.start), reason, detector)
            for slot in done.drop:  # not in any plan yet: nobody waits for them
                member = self.book.members[slot]
                member.move(S.LEFT)
                member.says(f"no longer wanted before it joined: {reason}")
                self.book.depart(member, self.group.actor_id(member.handle))
                self.group.kill(member.handle)
            if done.drop:
                self.spares.wake()  # a dropped slot waiting for a spare stops waiting
                self._note("info", f"{reason}: {', '.join(done.drop)} dropped before joining", slots=list(done.drop))
            if done.leave:
                for slot in done.leave:
                    self.book.members[slot].move(S.LEAVING)
                self.reshape(tuple(s for s in self.book.live() if s not in done.leave), reason, detector, time.time(),
                             leavers=done.leave)
            return done

    def replace(self, slot: str) -> None:
        """A worker for `slot`'s place (the supervisor's decision after a member's end)."""
        self._tasks.spawn(self.converge(f"replace {slot}", "replacement"))

    async def scale(self, count: int, wait: bool = True) -> None:
        """Grow or shrink to `count` workers (`Coordinator.scale` says how); raises ValueError, the reason in
        one line, where nothing can be done."""
        w = self.cfg.workers
        high = w.max if w.max is not None else w.count  # a parsed config's max is set (count by default)
        if not w.min <= count <= high:
            raise ValueError(f"scale: {count} workers is outside [workers.min, workers.max] = [{w.min}, {w.max}]")
        refusal = share_refusal(count, self.cfg.workload.batch_size, w.count, w.batch_mode, self.book.batch_norm)
        if refusal is not None:
            raise ValueError(f"scale: {refusal}")
        if not self.job.state.active or self.job.stop_kind is not None:
            raise ValueError(f"scale: the job is {'stopping' if self.job.state.active else self.job.state.value}; only a "
                             f"running or paused job can be scaled")
        previous = self.book.retarget(count)
        self._persist()
        done = await self.converge(f"scale to {count} requested", "scale request")
        if done is None:
            raise ValueError(f"scale: the job is {self.job.state.value} and stopping; it takes no new member")
        if done.missing and not done.start:
            self.book.retarget(previous)
            self._persist()
            raise ValueError(f"scale: no free slot for {done.missing} more worker(s): slots "
                             f"{', '.join(sorted(self.book.retired))} were retired by workers.failure_budget "
                             f"({w.failure_budget} failures)")
        if wait:
            await self.feed.wait(lambda: self._scaled(count), SCALE_WAIT_S)

    def _scaled(self, count: int) -> bool:
        """Whether a scale to `count` did what can be done now: no joiner is still coming, or each one that
        is waits for room Ray has not got; or the job took another course (another target, a stop, its end)."""
        if self.book.target_count != count or not self.job.state.active or self.job.stop_kind is not None:
            return True
        return all(self.book.members[s].unplaced for s in self.book.slots_in(S.STARTING, S.READY))

    # ------------------------------------------------------------------ the trial's policy switches
    def switch_policy(self, policy: dict, reason: str) -> None:
        """The trial's switch: the live members again, as a new membership epoch whose plan carries `policy`."""
        self.book.carry_policy(policy)
        self._note("policy_switch", reason, policy=policy["label"])
        self.reshape(self.book.live(), reason, "policy trial", time.time(), new_epoch=True)

    def offer(self, record: dict) -> None:
        """A newest committed record, for the trial's measurements."""
        if self.trial is not None:
            self.trial.offer(record, self.book.carry_policy)  # no longer fresh: later plans carry it as is
