"""The launcher: a slot's worker, from the decision to start it until it is ready to be admitted.

It owns the count of worker starts (each start of a slot is a new worker incarnation, which a
parameter server fences) and the start of each one, once the survivors of a departure have committed
without it: a hot spare when one is ready; else the next spare to be ready while spares are starting
that no other slot waits for; else a fresh actor, created off the event loop once the slot's previous
actor name is released, which gives way to a spare that becomes ready before it does
(`algorithms.rules.membership.joiner_source`). A joiner's fresh actor that Ray cannot place within
`workers.pause_after_s` is an event and shows in `status`. A start that fails counts against the
slot's failure budget and is tried again; past the budget the slot is retired. A start whose workload
factory raised what another start raised (`workload_bug`) ends the job instead. Once ready, the member
is READY and the coordinator's `admit` decides when it joins a plan.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from actors.control.book import MembershipBook
from actors.control.members import Member, describe, log
from actors.control.spares import SparePool
from actors.control.tasks import Tasks
from actors.control.workers import PlacementWatch, WorkerGroup
from actors.messages import ReadyAnswer
from actors.plan import WorkerSpec
from algorithms.rules.membership import JoinerSource, joiner_source, placement_shortfall
from algorithms.rules.supervision import JobState, MemberState, WorkloadFault, workload_bug
from core.schema import WorkloadRefused

S = MemberState
RESTART_AFTER_S = 1.0
"""A slot whose start failed (within its budget) is started again after this pause."""
NAME_RELEASE_TRIES = 200
NAME_RELEASE_WAIT_S = 0.05


class NoWorkerCanStart(RuntimeError):
    """Every slot the job started was retired before any plan: the job cannot begin (its reason names
    the first worker's error)."""


class Launcher:
    """Starts workers for slots; counts and retires slots whose starts or runs fail."""

    def __init__(self, book: MembershipBook, spares: SparePool, group: WorkerGroup, prefix: str,
                 spec_for: Callable[[str, int], WorkerSpec], fired: Callable[[], tuple[int, ...]],
                 note: Callable[..., Any], state: Callable[[], JobState], may_start: Callable[[], bool],
                 admit: Callable[[], Awaitable[None]], started: int = 0, tasks: Tasks | None = None,
                 placement: PlacementWatch | None = None,
                 fail: Callable[[str, dict], Awaitable[None]] | None = None) -> None:
        """`spec_for(slot, incarnation)`: the worker's spec; `fired()`: the injected faults already fired;
        `note(kind, reason, **detail)`: an event; `state()`: the job's state; `may_start()`: whether
        workers start now (not once a stop is decided or the job ended); `admit()`: admit ready workers;
        `tasks`: where its tasks run (the coordinator's: actors/control/tasks.py); `placement`: tells a
        joiner that Ray cannot place (None: not looked at); `fail(reason, detail)`: end the job FAILED, on a
        bug in the workload's factory (None: such a start counts as any failed start)."""
        self.book, self.spares, self.group, self.prefix = book, spares, group, prefix
        self._spec_for, self._fired, self._note = spec_for, fired, note
        self._state, self._may_start, self._admit = state, may_start, admit
        self.started = started
        """Worker starts so far."""
        self._restarting: set[str] = set()
        """Slots whose failed start waits its pause before the next try."""
        self._first_retired_by = ""
        """The failure that retired the first slot to be retired (a job that cannot start says it)."""
        self._hold: asyncio.Task | None = None
        self._tasks = tasks or Tasks()
        self._watch = placement
        self._fail = fail

    def spawn(self, slots: list[str], reason: str, detector: str) -> None:
        """Start a worker for each slot; each is admitted by a plan once ready (imports done, data built)."""
        decided = time.time()
        for slot in slots:
            member = Member(slot, None, join_reason=(reason, detector, decided))
            self.book.members[slot] = member
            self._tasks.spawn(self._bring_up(member))

    def _still_starting(self, member: Member) -> bool:
        return self._may_start() and self.book.members.get(member.slot) is member and member.state == S.STARTING

    async def _bring_up(self, member: Member) -> None:
        try:
            await self._start(member)
        except Exception as err:  # noqa: BLE001 - a task's error would otherwise reach only Ray's logs
            log.exception("starting %s failed", member.slot)
            if self.book.members.get(member.slot) is member and member.state == S.STARTING:
                await self.slot_failed(member, "start", f"worker {member.slot} could not be started: {describe(err)}")

    async def _start(self, member: Member) -> None:
        if not self._still_starting(member):
            return
        self.started += 1
        member.numbered(self.started)
        spec = self._spec_for(member.slot, member.incarnation)
        fired = self._fired()
        # A start would take the cores of a small node from the survivors of a departure while they
        # re-form: a fresh actor's (a process, imports: about a second of CPU), and a spare's adoption too
        # (its replica built and its group store served: about 10 ms of a core, measured at the survivors'
        # re-form). It waits for their first step without the departed member (at most ADMIT_HOLD_S; a
        # joiner is admitted only after that step anyway).
        await self.departure_settled()
        if not self._still_starting(member):
            return
        info = await self._spare_for(member, spec, fired)
        if info is None:
            handle = await self._new_actor(member, spec)
            if handle is None:
                return
            try:  # no timeout: Ray places the actor when there is room (the job may be PAUSED until then)
                info = await self._new_or_spare(member, handle, spec, fired)
            except Exception as err:  # noqa: BLE001 - the worker could not start (user code in the factory, ...)
                if self.book.members.get(member.slot) is member and member.state == S.STARTING:
                    await self._start_failed(member, err)
                return
        if self.book.members.get(member.slot) is not member or member.state != S.STARTING:
            return  # stopped or replaced meanwhile
        member.placed(info)
        self.book.note_model(info)
        member.move(S.READY)
        await self._admit()

    async def _start_failed(self, member: Member, err: Exception) -> None:
        """A worker whose start raised: a bug in the workload's factory (`workload_bug`: the same failure in
        another slot, or again in this one) ends the job with the user's file and line; any other failure
        counts against the slot."""
        cause = getattr(err, "cause", None)  # the exception the actor raised (Ray's error wraps it)
        fault = getattr(cause, "fault", None)
        if not isinstance(fault, WorkloadFault):
            await self.slot_failed(member, "start", f"worker {member.slot} failed to start: {describe(err)}")
            return
        bug = workload_bug(fault, member.slot, self.book.workload_faults)
        self.book.note_workload_fault(member.slot, fault)
        if bug is None or self._fail is None:
            await self.slot_failed(member, "start", f"worker {member.slot} failed to start: {fault.line}")
            return
        reason = f"no worker could start: {bug}" if self.book.plan is None else bug
        await self._fail(reason, {"slot": member.slot, "detector": "workload", "cause": fault.line,
                                  "traceback": fault.traceback})

    async def _spare_for(self, member: Member, spec: WorkerSpec, fired: tuple[int, ...]) -> ReadyAnswer | None:
        """A hot spare becomes `member`'s worker: a ready one, or, while spares are starting that no other
        slot waits for, the next one to be ready (`joiner_source`). Its ready info; None: start a new actor."""
        while self._still_starting(member):
            source = joiner_source(self.spares.ready(), self.spares.starting(), self.spares.waiting)
            if source is JoinerSource.NEW_ACTOR:
                return None
            if source is JoinerSource.SPARE:
                info = await self.spares.adopt(member, spec, fired)
                if info is not None:
                    return info
                continue  # the spare died idle: look again
            member.waits("waiting for a hot spare to be ready")
            try:
                await self.spares.changed()
            finally:
                member.waits()
        return None

    async def _new_actor(self, member: Member, spec: WorkerSpec) -> Any:
        """A fresh actor for `member`'s slot, created once the slot's previous actor name is gone; None when
        the member no longer starts."""
        name = f"{self.prefix}/{member.slot}"
        for _ in range(NAME_RELEASE_TRIES):  # a replacement waits for its slot's previous actor name to go
            if self.group.lookup(name) is None:
                break
            await asyncio.sleep(NAME_RELEASE_WAIT_S)
        if not self._still_starting(member):
            return None
        # created in a thread: registering a named detached actor waits for Ray's GCS (measured: 116 ms
        # while the GCS handled a death), and on the event loop that held up the survivors' reports
        handle = await asyncio.to_thread(self.group.create, name, spec)
        if not self._still_starting(member):
            self.group.kill(handle)
            return None
        member.runs_in(handle)
        if self._watch is not None and self.book.plan is not None:  # a joiner (the first members: `first_members`)
            self._tasks.spawn(self._watch_placement(member, handle, self._watch))
        return handle

    async def _new_or_spare(self, member: Member, handle: Any, spec: WorkerSpec, fired: tuple[int, ...]) -> ReadyAnswer:
        """The new actor's ready info, or that of a spare that becomes ready first (the new actor is then
        killed): a slot never waits for an actor that Ray may be unable to place while a spare sits ready."""
        fresh = asyncio.ensure_future(self.group.ready(handle, fired))
        changed: asyncio.Future | None = None
        try:
            while self.spares.want:
                changed = asyncio.ensure_future(self.spares.changed())
                await asyncio.wait((fresh, changed), return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if fresh.done():
                    break
                if self.spares.ready() and self._still_starting(member):
                    info = await self.spares.adopt(member, spec, fired)
                    if info is not None:
                        self.group.kill(handle)
                        return info
            return await fresh
        finally:
            fresh.cancel()
            if changed is not None:
                changed.cancel()

    async def _watch_placement(self, member: Member, handle: Any, placement: PlacementWatch) -> None:
        """An event, and the member's cause in `status`, once Ray has not placed its actor within the grace
        and the cluster lacks its room; the cause goes once it is placed."""
        waiting = lambda: self._still_starting(member) and member.handle is handle  # noqa: E731
        short = await placement.shortfall(handle, waiting)
        if short is None:
            return
        member.waits(f"cannot be placed: it {short}", unplaced=True)
        self._note("unplaced", f"{member.slot} cannot be placed after {placement.grace_s:g}s: it {short}; it joins once "
                               f"Ray has room or a hot spare is ready", slot=member.slot,
                   asks={"CPU": placement.cpus, "GPU": placement.gpus})
        if await placement.placed(handle, waiting):
            member.waits()

    async def first_members(self, starting: Callable[[bool, str], None]) -> tuple[str, ...]:
        """All `count` workers ready, or at least `min` after `start_grace_s`. Below `min` after
        `pause_after_s`, `starting(unplaced, cause)` says why: some worker cannot be placed (no process
        yet and the cluster lacks the resources it asks for: named), or the placed ones are still
        starting (imports, data). A worker with no process yet while its resources are free is being
        placed (Ray's worker start can take seconds on a loaded machine), not stuck."""
        w = self.book.cfg.workers
        assert w.max is not None  # WorkersConfig.__post_init__ fills it in
        started = time.monotonic()
        while True:
            ready = tuple(self.book.ready_to_admit())
            waited = time.monotonic() - started
            if len(ready) >= w.count or (len(ready) >= w.min and waited >= w.start_grace_s):
                return ready
            if self._state().terminal:  # ended meanwhile (a bug in the workload's factory): nothing to begin
                raise NoWorkerCanStart(f"the job ended while its workers started ({self._state().value})")
            if not self.book.slots_in(S.STARTING, S.READY) and not self._restarting:
                # nothing is starting and nothing starts before the first plan: no member can ever come
                raise NoWorkerCanStart(self._why_none_started(len(ready)))
            if len(ready) < w.min and waited >= w.pause_after_s:
                starting(*await self._placement(len(ready)))
            await asyncio.sleep(0.1)

    def _why_none_started(self, up: int) -> str:
        w = self.book.cfg.workers
        retired = ", ".join(sorted(self.book.retired)) or "none"
        why = ("the workload refused itself" if WorkloadRefused.__name__ in (self._first_retired_by or "")
               else "retired by their failure budget")
        return (f"no worker could start ({up} of workers.min = {w.min} up; slots {retired} {why}): "
                f"{self._first_retired_by or 'no worker was started'}")

    async def _placement(self, up: int) -> tuple[bool, str]:
        w = self.book.cfg.workers
        waiting = [self.book.members[s] for s in self.book.slots_in(S.STARTING)]
        placed = await asyncio.to_thread(lambda: [self.group.is_placed(m.handle) for m in waiting])
        unplaced = sum(1 for p in placed if p is False)
        short = placement_shortfall(w.cpus, w.gpus, await asyncio.to_thread(self.group.free_resources)) if unplaced else None
        if short is not None:
            return True, (f"waiting for resources: {up} of workers.min = {w.min} workers up; {unplaced} cannot be "
                          f"placed: each {short}")
        return False, (f"{len(waiting) + len(self.book.slots_in(S.READY))} of {w.count} workers placed, {up} up: "
                       f"waiting for the others to start (imports, workload)")

    async def departure_settled(self) -> None:
        """Until the survivors of a departure committed without it (or the hold ended): one poll shared
        by every joiner waiting (each polling the membership on its own cost joiners x members)."""
        if self._hold is None or self._hold.done():
            if not self.book.held_departure(self._state()):
                return

            async def poll() -> None:
                while self.book.held_departure(self._state()):
                    await asyncio.sleep(0.02)
            self._hold = self._tasks.spawn(poll())
        await asyncio.shield(self._hold)

    async def slot_failed(self, member: Member, phase: str, cause: str) -> bool:
        """Count a failure against the slot; retire it past its budget, else (a failed start) start it
        again. True if retired."""
        slot = member.slot
        if self.book.count_failure(slot, cause):
            self._first_retired_by = self._first_retired_by or cause
            member.ends_before_training(S.RETIRED, self.book.retired[slot])
            if phase == "start":
                self.book.depart(member, self.group.actor_id(member.handle))
                self.group.kill(member.handle)
            self._note("retired", f"slot {slot} {self.book.retired[slot]}", slot=slot, failures=self.book.failures[slot])
            return True
        if phase == "start":
            member.ends_before_training(S.FAILED, cause)
            self.book.depart(member, self.group.actor_id(member.handle))
            self.group.kill(member.handle)  # its resources and its name go: the next start of the slot needs them
            self._note("failure", cause, slot=slot, detector="start", failures=self.book.failures[slot])
            self._restarting.add(slot)
            try:
                await asyncio.sleep(RESTART_AFTER_S)
                if self._may_start():
                    self.spawn([slot], f"restart {slot} after: {cause}", "replacement")
            finally:
                self._restarting.discard(slot)
        return False
