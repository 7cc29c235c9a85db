"""The spare pool: hot spares started ahead of need and handed to a slot that needs a worker.

It owns the spares (oldest first) and the count of spares ever started (their names). A spare is a
worker actor with its imports done and its workload built, outside every group; `adopt` hands the
oldest ready one to a slot (`adopt` on the actor makes it that slot's worker) and a new spare
starts behind it once the membership has settled. A spare's name reaches the state file before its
actor exists, so that a restarted coordinator can kill the spares a dead incarnation started.
Slots that wait for a spare (the launcher's) wait on `changed()`: a spare became ready, failed to
start, or was found unplaceable (an event says what it asks and what the cluster has free).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from actors.control.members import Member, Spare, describe
from actors.control.tasks import Tasks
from actors.control.workers import PlacementWatch, WorkerGroup
from actors.messages import ReadyAnswer
from actors.plan import WorkerSpec

SPARE_SETTLE_S = 10.0
"""A spare that replaces one taken starts once no reshape is pending, or after this long at most."""
RETRY_AFTER_S = 5.0
ADOPT_TIMEOUT_S = 60.0


class SparePool:
    """`workers.spares` hot spares: started, kept ready, handed over, killed at the end."""

    def __init__(self, want: int, group: WorkerGroup, prefix: str, spec_for: Callable[[str], WorkerSpec],
                 save: Callable[[], int], saved: Callable[[int, float], bool], note: Callable[..., Any],
                 wanted: Callable[[], bool], settled: Callable[[], bool], started: int = 0,
                 tasks: Tasks | None = None, placement: PlacementWatch | None = None) -> None:
        """`prefix`: the job's actor names' (a spare is `PREFIX/spareN`); `spec_for(slot)`: its worker spec; `save()` writes the state
        file (its names in it) and `saved(number, timeout)` waits for that write; `note(kind, reason, **detail)` records an event;
        `wanted()`: whether spares are started at all now (not while stopping or ended); `settled()`:
        whether the membership has settled (no reshape pending, no joiner waiting); `tasks`: where its
        tasks run (the coordinator's: actors/control/tasks.py); `placement`: tells a spare that Ray cannot
        place (None: not looked at)."""
        self.want, self.group, self.prefix, self.spec_for = want, group, prefix, spec_for
        self._save, self._saved, self._note, self._wanted, self._settled = save, saved, note, wanted, settled
        self.spares: list[Spare] = []
        self.started = started
        self._settling: asyncio.Task | None = None
        self._tasks = tasks or Tasks()
        self._placement = placement
        self._changed: asyncio.Event | None = None
        self.waiting = 0
        """Slots waiting in `changed()` now."""

    def names(self) -> list[str]:
        return [s.name for s in self.spares]

    def ready(self) -> int:
        return sum(1 for s in self.spares if s.ready)

    def starting(self) -> int:
        """Spares on their way to ready: starting, and not found unplaceable."""
        return sum(1 for s in self.spares if not s.ready and not s.unplaced)

    async def changed(self) -> None:
        """Until a spare becomes ready, fails to start or is found unplaceable, or the pool is emptied."""
        if self._changed is None:
            self._changed = asyncio.Event()
        changed = self._changed
        self.waiting += 1
        try:
            await changed.wait()
        finally:
            self.waiting -= 1

    def wake(self) -> None:
        """Wake every slot waiting in `changed()` (each looks at the pool again, oldest waiter first)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def status(self) -> tuple[dict, ...]:
        return tuple(s.status() for s in self.spares)

    def fill(self) -> None:
        """Start spares until `want` are up or starting."""
        if not self._wanted():
            return
        new = []
        while len(self.spares) < self.want:
            self.started += 1
            slot = f"spare{self.started}"
            spare = Spare(f"{self.prefix}/{slot}")
            self.spares.append(spare)
            new.append((spare, self.spec_for(slot)))
        if not new:
            return
        number = self._save()
        for spare, spec in new:
            self._tasks.spawn(self._up(spare, spec, number))

    def fill_when_settled(self) -> None:
        """Start the spares that replace those taken once the membership has settled (or after
        SPARE_SETTLE_S). A spare's start (a process, imports, the workload: about a second of CPU)
        competes with the survivors' re-form and the replacement's join for the node's cores; started
        at the death, it once held a survivor's plan 164 ms and a state load 140 ms on a 2-core machine."""
        if self._settling is not None and not self._settling.done():
            return

        async def when_settled() -> None:
            deadline = time.monotonic() + SPARE_SETTLE_S
            while not self._settled() and time.monotonic() < deadline and self._wanted():
                await asyncio.sleep(0.05)
            self.fill()
        self._settling = self._tasks.spawn(when_settled())

    async def _up(self, spare: Spare, spec: WorkerSpec, persisted: int) -> None:
        try:
            # its name on disk first: a restarted coordinator kills the spares its dead incarnation started
            if not await asyncio.to_thread(self._saved, persisted, 30):
                raise RuntimeError("its name could not be written to the state file (a restarted coordinator "
                                   "would not find it)")
            handle = await asyncio.to_thread(self.group.create, spare.name, spec)
            if spare not in self.spares:  # the job ended (or the spare was dropped) meanwhile
                self.group.kill(handle)
                return
            spare.created(handle)
            if self._placement is not None:
                self._tasks.spawn(self._watch_placement(spare, self._placement))
            info = await self.group.ready(handle, ())  # no timeout, as for a worker: placed when there is room
        except Exception as err:  # noqa: BLE001 - its start failed: another one starts after a pause
            if spare in self.spares:
                self.spares.remove(spare)
                self._note("info", f"hot spare {spare.status()['name']} failed to start: {describe(err)}")
                self.wake()
                await asyncio.sleep(RETRY_AFTER_S)
                self.fill()
            return
        spare.placed(info)
        self.wake()

    async def _watch_placement(self, spare: Spare, placement: PlacementWatch) -> None:
        """An event once Ray has not placed `spare` within the grace and the cluster lacks its room."""
        waiting = lambda: spare in self.spares and not spare.ready  # noqa: E731
        short = await placement.shortfall(spare.handle, waiting)
        if short is None:
            return
        name = spare.status()["name"]
        spare.lacks(short)
        self._note("unplaced", f"hot spare {name} cannot be placed after {placement.grace_s:g}s: it {short}; it starts "
                               f"once Ray has room (a local Ray is sized for workers.max + workers.spares; on a "
                               f"cluster, add nodes or lower workers.spares)", spare=spare.name,
                   asks={"CPU": placement.cpus, "GPU": placement.gpus})
        self.wake()  # a slot that waits for it starts a new worker instead (and still takes it once ready)

    async def adopt(self, member: Member, spec: WorkerSpec, fired: tuple[int, ...]) -> ReadyAnswer | None:
        """The oldest ready spare becomes `member`'s worker (a new spare starts behind it); its ready
        info, or None when no spare is ready or the one taken is gone (the member keeps the actor it had,
        if any)."""
        spare = next((s for s in self.spares if s.ready), None)
        if spare is None:
            return None
        assert spare.ready_at is not None  # a ready spare: ready_at is set
        self.spares.remove(spare)
        self.fill_when_settled()
        before = member.handle, member.actor_name  # a new actor it started meanwhile, or none
        member.runs_in(spare.handle, spare.name)
        try:
            info = await self.group.adopt(spare.handle, spec, fired, timeout=ADOPT_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - the spare died idle, or the replica could not be built
            self.group.kill(spare.handle)
            member.runs_in(*before)
            self._note("info", f"hot spare {spare.status()['name']} could not become {member.slot}: {describe(err)}; "
                               f"starting a new worker", slot=member.slot)
            return None
        self._note("info", f"{member.slot} is hot spare {spare.status()['name']} (ready after "
                           f"{spare.ready_at - spare.started_at:.1f}s, up for {time.time() - spare.started_at:.1f}s)",
                   slot=member.slot, spare=spare.name, started_at=spare.started_at, ready_at=spare.ready_at)
        return info

    def kill_all(self) -> None:
        for spare in self.spares:
            self.group.kill(spare.handle)
        self.spares = []
        self.wake()
