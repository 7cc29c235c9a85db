"""The supervisor: it sees members end, hang, fall silent or fall behind, and carries out what
`algorithms/supervision.decide` makes of it.

It owns the detectors and their state: each member's watch (which returns when its run ends and
raises when its process dies), the heartbeat loop (a member that stops answering, or whose step
never ends, is evicted), the probe after a failed collective (members that do not answer are
evicted; if all answer, the group is re-formed) and the straggler watch; their outcomes are taken in
batches (actors/control/outcomes.py).
Each outcome and each stop request becomes a frozen `JobView` and an event for `decide`; the
decision is carried out through `Actions`, the few operations the coordinator shell exposes
(publish, reshape, transition, end, finish, stop). It never reads the shell's attributes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

from actors.control.book import MembershipBook
from actors.control.members import Member, log
from actors.control.outcomes import Outcome, Outcomes
from actors.control.tasks import Tasks
from actors.control.workers import WorkerGroup
from actors.messages import RunOutcome
from algorithms.rules.kinds import Kind
from algorithms.rules.stragglers import StragglerWatch
from algorithms.rules.supervision import Decision, JobState, JobView, MemberEnded, MemberState, StopRequested, decide
from core.schema import JobConfig

S = MemberState
PROBE_S = 1.0
"""How long a member may take to answer a probe after a collective failed."""
STRAGGLER_WARMUP_STEPS = 20
"""Steps a member trains before its step-time estimate is compared with the others'."""
STRAGGLER_EVERY_S = 0.5
"""The stragglers are found again at most this often (over every member: not at every report)."""
HEARTBEAT_SLICES = 16


class Actions(Protocol):
    """What the supervisor asks of the coordinator to carry out a decision (the coordinator's shell
    forwards each one to the part that owns it)."""

    @property
    def state(self) -> JobState: ...
    @property
    def stop_kind(self) -> str | None: ...
    def view(self) -> JobView: ...
    def transition(self, to: JobState, reason: str) -> None: ...
    def set_cause(self, cause: str | None) -> None: ...
    def reshape(self, members: tuple[str, ...], reason: str, detector: str, detected_at: float,
                new_epoch: bool = False, *, aborts: bool = False) -> Any: ...
    def publish(self, members: tuple[str, ...], reason: str) -> Any: ...
    def reform(self, reason: str) -> None: ...
    def abort_epoch(self, reason: str) -> None: ...
    def begin_stop(self, kind: str, cause: str, stop_step: int) -> None: ...
    def restore_on_admit(self) -> None: ...
    def replace(self, slot: str) -> None: ...
    async def slot_failed(self, member: Member, phase: str, cause: str) -> bool: ...
    async def departure_settled(self) -> None:
        """Returns once the survivors of a departure have committed a step without it (or the hold ended)."""
    async def end(self, state: JobState, reason: str, detail: dict | None = None, quiet: bool = False) -> None: ...
    async def stop_now(self, kind: str | None, state: JobState, reason: str) -> None:
        """A stop of `kind` that has nothing to wait for: the job ends in `state` at once."""
    async def finish(self) -> None: ...


class Supervisor:
    """Detectors (watch, heartbeats, probes, stragglers) and the decisions they lead to."""

    def __init__(self, cfg: JobConfig, book: MembershipBook, group: WorkerGroup, actions: Actions,
                 note: Callable[..., Any], kind: Kind, step: Callable[[], int], tasks: Tasks | None = None) -> None:
        """`tasks`: where its tasks run (the coordinator's: actors/control/tasks.py)."""
        self.cfg, self.book, self.group, self.actions, self._note, self.kind = cfg, book, group, actions, note, kind
        self._step = step
        self._tasks = tasks or Tasks()
        self.outcomes = Outcomes(book, group)
        """Members' ends as the detectors see them, taken in batches (actors/control/outcomes.py)."""
        self.stragglers = StragglerWatch()
        self._stragglers_at = 0.0
        self._probing = False
        self._batching = False
        self._abort: str | None = None
        """A batch's abort of the epoch (the first death's cause) until its plan carries it."""
        self._deferred: tuple[tuple[str, ...], str, str, float, int] | None = None
        """A batch's re-form, published once its last outcome is decided: (members, cause, detector,
        first seen, how many ended)."""
        self._to_kill: list[Any] = []
        """Actors of a batch's ended members, killed once the survivors committed without them (`handle`)."""

    def start(self) -> None:
        self.outcomes.start()

    # ------------------------------------------------------------------ detectors
    def run(self, member: Member) -> None:
        """Start an admitted member's run, and watch it."""
        self.group.run(member.handle)
        member.move(S.TRAINING)
        self.watch(member)

    def watch(self, member: Member) -> None:
        """Await the member's run; its end (or its process's death) becomes an outcome."""
        async def watched() -> None:
            kind, outcome = await self.group.watch(member.handle)
            outcome = outcome if outcome.slot else dataclasses.replace(outcome, slot=member.slot)
            await self.outcomes.put((member, kind, outcome, time.time()))
        loop = asyncio.get_running_loop()
        member.watched_by(self._tasks.spawn(watched()))
        # on this node, its process's lifeline: the death known as the kill lands, not once Ray hears
        self.group.watch_exit(member.node, member.pid, member.lifeline,
                              on_end=lambda: self._call_soon(loop, self._lifeline_ended, member),
                              wanted=lambda: member.state == S.TRAINING and member.evicted is None)

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, call: Callable[[Member], None], member: Member) -> None:
        loop.call_soon_threadsafe(call, member)

    def _lifeline_ended(self, member: Member) -> None:
        """A member's process on this node has begun to end (its lifeline's mutex was released): evict it
        at once, before its memory is freed and its sockets close (actors/lifeline.py). The lifeline's
        holder is a thread that ends only with its process, and a SIGKILL ends a process's threads one by
        one: the main thread, whose flags /proc shows, may not be flagged exiting yet when the holder's
        end wakes the watcher (seen under load here), so the lifeline's word is taken either way; a process
        not yet seen exiting is also sent its SIGKILL. An end the coordinator caused (an eviction, a
        retirement, the job's end) finds the member no longer training: nothing to do."""
        if member.state != S.TRAINING or member.evicted is not None or self.actions.state.terminal:
            return
        exiting = self.group.process_state(member.node, member.pid) != "running"
        self._tasks.spawn(self.evict(
            member, "actor death", f"worker {member.slot}'s process is exiting (its lifeline ended)", exiting=exiting))

    async def handle(self, batch: list[Outcome]) -> None:
        """Decide each outcome of a batch in turn; the survivors' re-form goes out once, after the last."""
        self._batching, self._deferred, self._abort = True, None, None
        try:
            for outcome in batch:
                await self.on_outcome(*outcome)
        finally:
            self._batching = False
            deferred, self._deferred = self._deferred, None
            abort, self._abort = self._abort, None
        try:
            if deferred is not None and not self.actions.state.terminal:
                members, cause, detector, seen, ended = deferred
                if ended > 1:
                    cause = f"{ended} members ended together; the last: {cause}"
                # the plan carries the epoch's abort: one call to each survivor, and the plan sooner
                self.actions.reshape(members, cause, detector, seen, aborts=abort is not None)
                abort = None
        finally:
            if abort is not None:  # no plan went out to carry it
                self.actions.abort_epoch(abort)
            to_kill, self._to_kill = self._to_kill, []
            if to_kill:
                self._tasks.spawn(self._kill_once_settled(to_kill))

    async def _kill_once_settled(self, handles: list[Any]) -> None:
        """Kill a batch's ended actors once the survivors have committed without them: each kill is a
        synchronous call to Ray's GCS (about 3 ms of the event loop here, and the GCS's own work), and
        their processes are gone or going already."""
        try:
            await self.actions.departure_settled()
        finally:
            for handle in handles:
                self.group.kill(handle)

    def progress(self, member: Member, mark: int, compute_s: float) -> None:
        """A member's report: its step and step time, and the stragglers among the training members
        (events on each change; a member's first steps say nothing about its speed)."""
        now = time.time()
        member.reported(mark, now, compute_s)
        if now - self._stragglers_at < STRAGGLER_EVERY_S:
            return
        self._stragglers_at = now
        live = {slot: m.compute_s for slot, m in self.book.members.items()
                if m.state is S.TRAINING and m.step >= STRAGGLER_WARMUP_STEPS}
        for change in self.stragglers.update(live):
            verb = "is a straggler" if change.straggler else "is no longer a straggler"
            ratio = f": {change.ratio:.2f}x the median step time" if change.ratio else ""
            self._note("straggler", f"{change.slot} {verb}{ratio}", slot=change.slot,
                       straggler=change.straggler, ratio=round(change.ratio, 3))

    async def heartbeats(self) -> None:
        """Evict a worker that stops answering (SIGSTOP, frozen) or whose step never ends. Each period's
        heartbeats go out in HEARTBEAT_SLICES slices spread over the period, not in one burst (a burst
        of a thousand calls held the event loop about 20 ms, and a death's re-form waited behind it); each member
        gets one a period (before 2026-11-28 a job of fewer members than slices sent each one a slice, up
        to 16 a second)."""
        period = min(1.0, self.cfg.workers.heartbeat_s / 4)
        while not self.actions.state.terminal:
            members = list(self.book.members.values())
            size = -(-len(members) // HEARTBEAT_SLICES) or 1
            slices = [members[first:first + size] for first in range(0, len(members), size)] or [[]]
            for chunk in slices:  # as many slices as there are members, up to HEARTBEAT_SLICES: one period
                await asyncio.sleep(period / len(slices))
                for member in chunk:
                    if member.state == S.TRAINING and member.evicted is None and \
                            (member.beat_task is None or member.beat_task.done()):
                        member.beaten_by(self._tasks.spawn(self._beat(member)))

    async def _beat(self, member: Member) -> None:
        w = self.cfg.workers
        try:
            info = await self.group.heartbeat(member.handle, timeout=w.heartbeat_s)
        except asyncio.TimeoutError:
            await self.evict(member, "heartbeat", f"worker {member.slot} did not answer the heartbeat for "
                                                  f"{w.heartbeat_s:g}s (stopped or frozen)")
            return
        except Exception as err:  # noqa: BLE001 - a dead actor: its watch reports it
            log.debug("heartbeat of %s: %s", member.slot, err)
            return
        stuck_after = self.cfg.comm.timeout_s + 2.0
        if info.phase == "waiting" and info.phase_age_s > stuck_after and \
                self.actions.state in (JobState.RUNNING, JobState.RESHAPING):
            self.actions.reform(f"worker {member.slot} has waited {info.phase_age_s:.1f}s for a plan (its group did not form)")
        # A server kind's push has no collective timeout: a push unanswered this long is a hang too.
        waiting = {"compute": "computing", "communicate": "pushing"} if self.kind.pushes_each_step else {"compute": "computing"}
        if info.phase in waiting and info.phase_age_s > w.hang_timeout_s:
            await self.evict(member, "step progress", f"worker {member.slot}'s step {info.step} has been "
                                                      f"{waiting[info.phase]} for {info.phase_age_s:.1f}s "
                                                      f"(workers.hang_timeout_s = {w.hang_timeout_s:g})")

    async def collective_failed(self, slot: str, epoch: int, error: str) -> None:
        """A member's collective failed: evict at once any member whose process is exiting on this node
        (a killed worker's peers hear of it only as its sockets close, and Ray later still), probe that
        epoch's members and evict any that do not answer; if every one answers, the group itself is
        broken: re-form it at once as a new epoch. The report also says the member is alive
        (`Outcomes.next`: a death's batch waits for no survivor that did)."""
        self.outcomes.alive(slot, epoch)
        if epoch != self.book.epoch or self.actions.state not in (JobState.RUNNING, JobState.RESHAPING) or self._probing:
            return
        self._probing = True
        self._note("info", f"{slot}'s collective failed: probing the members", slot=slot, detector="collective failure",
                   probe=True)  # when the coordinator first heard of it (benchmarks/recovery.py's phases)
        try:
            members = [self.book.members[s] for s in self.book.live()]
            for member in members:  # a dying process on this node is seen at once, long before Ray's notice
                if member.slot != slot and self.group.process_state(member.node, member.pid) == "exiting":
                    await self.evict(member, "actor death", f"worker {member.slot}'s process is exiting (found when "
                                                            f"{slot}'s collective failed)", exiting=True)
            answers = await asyncio.gather(*(self.group.probe_heartbeat(m.handle, timeout=PROBE_S) for m in members))
            for member, (answer, died) in zip(members, answers):
                if died is not None:  # the probe learnt of a death before the member's watch did
                    await self.evict(member, "actor death", f"worker {member.slot} died (found when {slot}'s "
                                                            f"collective failed): {died[:160]}")
                elif answer is None:
                    await self.evict(member, "collective failure",
                                     f"worker {member.slot} did not answer after {slot}'s collective failed: {error[:160]}")
            if all(a is not None for a, _ in answers) and epoch == self.book.epoch:
                self.actions.reform(f"{slot}'s collective failed with every member alive: {error[:160]}")
        finally:
            self._probing = False

    async def evict(self, member: Member, detector: str, cause: str, exiting: bool = False) -> None:
        """Take the member for dead now, and kill it (a stopped or frozen process cannot answer Ray's kill
        request) unless its process is `exiting` already: then its outcome's handling kills its actor,
        after the survivors' plan is out."""
        if member.state != S.TRAINING or member.evicted is not None:
            return
        member.evict(detector, cause)
        self._note("info", f"evicting: {cause}", slot=member.slot, detector=detector)
        if not exiting:
            self.group.kill_process(member.node, member.pid)
            self.group.kill(member.handle)
        # Handled now: Ray may take many seconds to report an actor on a lost node as dead.
        await self.outcomes.put((member, "died", RunOutcome(False, error=cause), time.time()))

    # ------------------------------------------------------------------ decisions
    async def on_outcome(self, member: Member, kind: str, outcome: RunOutcome, seen: float) -> None:
        if self.book.members.get(member.slot) is not member:
            return  # an earlier incarnation of a slot that was started again
        what = "died" if kind == "died" else "raised an exception"
        fault = outcome.data_fault if kind == "error" else None
        bug = outcome.workload_fault if kind == "error" else None  # its error names the user's file and line
        detector, cause = member.evicted or (
            "actor death" if kind == "died" else "bad sample" if fault else "workload" if bug else "task error",
            fault.line if fault else f"worker {member.slot} {what}: {outcome.error}".strip())
        hung = member.evicted is not None and member.evicted[0] in ("heartbeat", "step progress")
        d = decide(self.actions.view(), MemberEnded(member.slot, kind, cause, detector, hung, fault, bug))
        if d.ignore:
            return
        if bug is not None:
            self.book.note_workload_fault(member.slot, bug)
        assert d.member is not None  # a member's end that is not ignored gets its new state
        member.move(d.member[1])
        if member.state == S.FINISHED and outcome.holds_state is False:
            member.holds(False)
            self._note("info", f"{member.slot} finished without a state of its own (no live member to receive one "
                               f"from): not one of the final model's replicas", slot=member.slot)
        if member.state in (S.LEFT, S.FINISHED):
            if member.state == S.LEFT:
                self.group.kill(member.handle)
            if d.finish:
                await self.actions.finish()
            return
        member.says(cause)
        detail = {"slot": member.slot, "detector": detector, "cause": outcome.error, "seen_at": seen,
                  "step": self._step(), "membership_epoch": self.book.epoch}
        if outcome.traceback:
            detail["traceback"] = outcome.traceback
        if self._batching and not (d.finish or d.end_now is not None):
            self._abort = self._abort or cause  # carried by the batch's plan, or sent once the batch is decided
            self._to_kill.append(member.handle)  # its process is gone or going: the survivors' plan first
        else:
            self.actions.abort_epoch(cause)
            self.group.kill(member.handle)
        if d.finish:  # the others had all finished: nothing is left to train
            self._note("failure", d.reason, **detail)
            await self.actions.finish()
            return
        if d.end_now is not None:
            await self.actions.end(d.end_now, d.reason, detail=detail)
            return
        if d.restore:
            self.actions.restore_on_admit()
        self._note("failure", d.reason if d.restore else d.failure or cause, **detail)
        if d.count_failure and await self.actions.slot_failed(member, "run", cause):
            member.move(S.RETIRED)
        self.book.depart(member, self.group.actor_id(member.handle))
        self.apply(d, cause, detector, seen)
        if d.replace:
            self.actions.replace(member.slot)

    def apply(self, d: Decision, cause: str, detector: str, seen: float) -> None:
        """Carry out a decision's stop, state change and plan."""
        if d.stop_kind is not None and self.actions.stop_kind is None:
            stop_step = 0 if d.stop_step == "held" else self._step() + 1
            self.actions.begin_stop(d.stop_kind, d.failure or (cause if d.stop_kind == "FAILED" else d.reason), stop_step)
        if d.transition == JobState.PAUSED:
            self.actions.set_cause(d.reason)
        if d.transition is not None and (d.transition != self.actions.state or d.transition == JobState.PAUSED):
            self.actions.transition(d.transition, d.reason)
        # A stop decided now publishes the stop at once; a death re-forms the survivors (a reshape), once
        # per batch of outcomes: each decision sees the members the ones before it ended, so the last
        # one's membership is the batch's (and a later decision without a plan, a pause, drops it).
        if d.publish is not None and d.stop_kind is not None:
            self._deferred = None
            self.actions.publish(d.publish, d.reason)
        elif self._batching:
            first = self._deferred[3] if self._deferred else seen
            count = self._deferred[4] + 1 if self._deferred else 1
            self._deferred = (d.publish, cause, detector, first, count) if d.publish is not None else None
        elif d.publish is not None:
            self.actions.reshape(d.publish, cause, detector, seen)

    async def stop(self, kind: str, reason: str) -> None:
        """A stop asked for (by a user, a limit, a target): every member stops at one committed step."""
        self._note("info", reason)
        d = decide(self.actions.view(), StopRequested(kind, reason))
        if d.ignore:
            return
        if d.end_now is not None:
            await self.actions.stop_now(d.stop_kind, d.end_now, d.reason)
            return
        self.apply(d, reason, "stop", time.time())
