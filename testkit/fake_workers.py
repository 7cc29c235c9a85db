"""An in-process worker group: the coordinator's whole loop without Ray, one event at a time.

`FakeWorkerGroup` answers every call of `WorkerGroup` the way a worker actor does (ready, adopt,
run, watch, set_plan, abort_epoch, heartbeat, status, records_after, final_state,
load_checkpoint), from plain objects on the test's event loop. A test makes things happen to a
worker (`die`, `finish`, `fail`, `hang`, a start that fails or never gets resources) and commits
steps under the current plan (`commit`), and members finish at a plan's stop step as real ones
do. Unit tests drive the coordinator's decisions with it (tests/unit/test_coordinator_paths.py);
`benchmarks/control_plane.py` runs 1,024 of these against one coordinator.

What it does not model: training, the group store and collectives, Ray's own latencies. A path
whose correctness depends on those keeps its end-to-end test.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.control.workers import WorkerGroup
from actors.messages import Heartbeat, ReadyAnswer, RunOutcome, WorkerStatus
from actors.plan import Plan, Progress, WorkerSpec


class FakeWorkerDied(Exception):
    """What a call to a dead fake worker raises."""


@dataclass(eq=False)
class FakeWorker:
    name: str
    spec: WorkerSpec
    pid: int
    alive: bool = True
    running: bool = False
    hung: bool = False
    """Answers no heartbeat or probe (a SIGSTOPped process)."""
    phase: str = "waiting"
    phase_since: float = field(default_factory=time.monotonic)
    plans: list[Plan] = field(default_factory=list)
    """The plans it received (the newest few)."""
    plan_at: float = 0.0
    """When (perf_counter) the newest plan reached it."""
    aborted: list[int] = field(default_factory=list)
    step: int = 0
    holds_state: bool = True
    kept: list[dict] = field(default_factory=list)
    """Its newest committed records (what `records_after` answers)."""
    ended: asyncio.Future | None = None
    ready_gate: asyncio.Event | None = None
    """While set to an unset event, `ready` waits (no resources yet)."""
    fail_start: str | None = None

    @property
    def slot(self) -> str:
        return self.spec.slot

    @property
    def plan(self) -> Plan | None:
        return self.plans[-1] if self.plans else None

    def end(self, kind: str, outcome: RunOutcome) -> None:
        if self.ended is None:
            self.ended = asyncio.get_running_loop().create_future()
        if not self.ended.done():
            self.ended.set_result((kind, outcome))


class FakeMetric:
    """A metric's values by tags: a counter's sum, a gauge's newest value, a histogram's observations."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.values: dict[tuple, Any] = {}

    def _key(self, tags: dict | None) -> tuple:
        return tuple(sorted((tags or {}).items()))

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.values[self._key(tags)] = self.values.get(self._key(tags), 0.0) + value

    def set(self, value: float, tags: dict | None = None) -> None:
        self.values[self._key(tags)] = value

    def observe(self, value: float, tags: dict | None = None) -> None:
        self.values.setdefault(self._key(tags), []).append(value)


class FakeWorkerGroup(WorkerGroup):
    """Fake worker actors on the caller's event loop; `workers` holds every one created."""

    def __init__(self, reconstructed: bool = False, free_cpus: float = 64.0) -> None:
        self.reconstructed = reconstructed
        self.free = {"CPU": free_cpus}
        self.workers: dict[str, FakeWorker] = {}
        self._by_slot: dict[str, FakeWorker] = {}
        self._by_name: dict[str, FakeWorker] = {}
        self._pids = itertools.count(10_000)
        self.unplaced = False
        """While True, new workers get no resources: `ready` waits until `place()` (and they are not placed)."""
        self.no_room: set[str] = set()
        """Actor names that, when they start, get no resources until `place(name)` (as with `unplaced`)."""
        self.held: dict[str, asyncio.Event] = {}
        """Actor name -> the gate its start waits for: placed, but its start (imports, the workload) is not
        done until `release(name)`."""
        self.ready_delay_s = 0.0
        """How long a new worker's start takes once placed (imports, the workload)."""
        self.start_failures: dict[str, str] = {}
        """slot -> error: a new worker of that slot fails to start (its workload raises)."""
        self.plans_sent = 0
        self._plan_members: tuple[int, frozenset] = (-1, frozenset())
        self.kills = 0
        self.processes_killed: list[tuple[str, int]] = []
        """(node, pid) of each SIGKILL the coordinator sent to a worker's process (recorded only)."""
        self.processes: dict[int, str] = {}
        """pid -> "running" or "exiting": what a test says of a process on this node (`process_state`)."""
        self.metrics: dict[str, FakeMetric] = {}
        """What the coordinator exported, by metric name."""
        self.exit_watches: dict[int, tuple[Callable[[], None], Callable[[], bool]]] = {}
        """pid -> (on_end, wanted) of each lifeline the coordinator watches (`watch_exit`; `exit_begins`)."""

    # ------------------------------------------------------------------ what a test does to workers
    def current(self, slot: str) -> FakeWorker:
        """The newest live-or-dead worker serving `slot` (a spare it adopted, or the slot's own actor)."""
        return self._by_slot[slot]

    def die(self, slot: str, why: str = "SIGKILL") -> None:
        worker = self.current(slot)
        worker.alive = False
        worker.end("died", RunOutcome(False, error=f"The actor died: {why}"))

    def fail(self, slot: str, error: str = "RuntimeError: boom") -> None:
        self.current(slot).end("error", RunOutcome(False, error=error, traceback="Traceback (fake)"))

    def finish(self, slot: str, holds_state: bool = True) -> None:
        worker = self.current(slot)
        worker.running = False
        worker.end("finished", RunOutcome(True, worker.step, slot, holds_state=holds_state))

    def hang(self, slot: str) -> None:
        self.current(slot).hung = True

    def exit_begins(self, slot: str) -> threading.Thread:
        """The worker's process is SIGKILLed and its exit has begun: flagged exiting, answering nothing,
        and not yet reported dead (its memory is still being freed), while its lifeline's watcher is
        woken from a thread of its own, as the real one is (actors/lifeline.py)."""
        worker = self.current(slot)
        worker.hung = True
        self.processes[worker.pid] = "exiting"
        on_end, _ = self.exit_watches[worker.pid]
        thread = threading.Thread(target=on_end)
        thread.start()
        return thread

    def place(self, name: str | None = None) -> None:
        """Resources for every worker waiting for them (and for new ones); with `name`, for that actor only."""
        self.unplaced = self.unplaced and name is not None
        for worker in self.workers.values():
            if worker.ready_gate is not None and name in (None, worker.name):
                worker.ready_gate.set()

    def no_room_for(self, name: str) -> None:
        """The actor named `name`, when it starts, is not placed until `place(name)` (`free` says what the
        cluster has free meanwhile)."""
        self.no_room.add(name)

    def hold(self, name: str) -> None:
        """The actor named `name` (a spare: `job/run/spareN`), when it starts, is placed but not ready until `release(name)`."""
        self.held[name] = asyncio.Event()

    def release(self, name: str) -> None:
        self.held[name].set()

    async def commit(self, coordinator: Any, steps: int = 1, compute_s: float = 0.01) -> int:
        """`steps` committed steps under the coordinator's current plan, reported as a real rank 0 (or,
        for each-member kinds, every member) reports them; members finish at the plan's stop step.
        Returns the newest step."""
        plan = coordinator.book.plan
        members = [self.current(s) for s in plan.members]
        each = coordinator.history.reporter.each_member_reports
        for _ in range(steps):
            step = max(w.step for w in members) + 1
            if (plan.stop_step is not None and step > plan.stop_step) or step > (coordinator.cfg.stop.max_steps or step):
                break
            for worker in members:
                worker.step = step
                worker.phase, worker.phase_since = "compute", time.monotonic()
            reporters = members if each else members[:1]
            for worker in reporters:
                record = {"step": step, "time": time.time(), "loss": 1.0 / step, "world_size": len(members),
                          "global_batch": plan.global_batch, "micro_steps": 1, "membership_epoch": plan.membership_epoch,
                          "bytes_sent": 1000 * step}
                if each:
                    record.update(slot=worker.slot, samples=plan.global_batch // len(members))
                worker.kept = (worker.kept + [record])[-64:]
                await coordinator.report(Progress(worker.slot, step, plan.membership_epoch, time.time(), (record,),
                                                  compute_s, mark=step))
        newest = max(w.step for w in members)
        last = coordinator.cfg.stop.max_steps
        if (plan.stop_step is not None and newest >= plan.stop_step) or (last is not None and newest >= last):
            for worker in members:
                if worker.ended is None or not worker.ended.done():
                    self.finish(worker.slot)
        return newest

    # ------------------------------------------------------------------ WorkerGroup
    def create(self, name: str, spec: WorkerSpec) -> FakeWorker:
        worker = FakeWorker(name, spec, next(self._pids), fail_start=self.start_failures.get(spec.slot))
        self.workers[name + f"#{worker.pid}"] = worker
        self._by_slot[spec.slot] = self._by_name[name] = worker
        return worker

    def lookup(self, name: str) -> FakeWorker | None:
        worker = self._by_name.get(name)
        return worker if worker is not None and worker.alive else None

    def set_plan(self, handle: FakeWorker, plan: Plan) -> None:
        if not handle.alive:
            return
        self.plans_sent += 1
        if plan.aborts_epoch is not None:
            handle.aborted.append(plan.aborts_epoch)
        handle.plans = (handle.plans + [plan])[-4:]
        handle.plan_at = time.perf_counter()
        if handle.running and plan.stop_step is not None and plan.stop_step <= handle.step and plan.stop_step >= 0:
            self.finish(handle.slot, handle.holds_state)  # already at (or past) the stop: done
        elif handle.running and handle.slot not in self._members_of(plan):
            self.finish(handle.slot, handle.holds_state)  # dropped by a scale-down: it leaves

    def run(self, handle: FakeWorker) -> None:
        if handle.alive:
            handle.running, handle.phase = True, "waiting"

    def abort_epoch(self, handle: FakeWorker, membership_epoch: int, reason: str) -> None:
        if handle.alive:
            handle.aborted.append(membership_epoch)

    def _members_of(self, plan: Plan) -> frozenset:
        """The plan's members as a set, made once per plan (a tuple's `in` per member is O(n^2) per plan)."""
        if self._plan_members[0] != plan.version:
            self._plan_members = (plan.version, frozenset(plan.members))
        return self._plan_members[1]

    async def _reach(self, handle: FakeWorker, timeout: float | None, hangs: bool = False) -> None:
        """What a call meets before its answer: a hung worker's heartbeat and status never come (the call
        times out), and a dead worker's calls raise."""
        if handle.hung and hangs:
            await asyncio.sleep(timeout if timeout is not None else 3600)
            raise asyncio.TimeoutError
        if not handle.alive:
            raise FakeWorkerDied(f"{handle.name} is dead")

    def _placed(self, handle: FakeWorker) -> ReadyAnswer:
        return ReadyAnswer(handle.slot, handle.pid, "127.0.0.1", "fake-node", handle.pid)

    async def ready(self, handle: FakeWorker, fired_faults: tuple[int, ...]) -> ReadyAnswer:
        await self._reach(handle, None)
        if self.unplaced or handle.name in self.no_room:
            handle.ready_gate = asyncio.Event()
            await handle.ready_gate.wait()
        if handle.name in self.held:
            await self.held[handle.name].wait()
        if self.ready_delay_s:
            await asyncio.sleep(self.ready_delay_s)
        if handle.fail_start:  # its workload raised while warming up: the actor itself stays up
            raise RuntimeError(handle.fail_start)
        return self._placed(handle)

    async def adopt(self, handle: FakeWorker, spec: WorkerSpec, fired_faults: tuple[int, ...], timeout: float) -> ReadyAnswer:
        await self._reach(handle, timeout)
        handle.spec = spec
        self._by_slot[spec.slot] = handle
        return self._placed(handle)

    def _heartbeat(self, handle: FakeWorker) -> Heartbeat:
        return Heartbeat(handle.step, handle.phase, time.monotonic() - handle.phase_since)

    def _status(self, handle: FakeWorker) -> WorkerStatus:
        plan = handle.plan
        rank = plan.rank_of(handle.slot) if plan else None
        return WorkerStatus(handle.slot, handle.pid, handle.step, 0, "training" if handle.running else "ready",
                            handle.holds_state, -1 if rank is None else rank, plan.membership_epoch if plan else 0, plan,
                            handle.pid)

    async def heartbeat(self, handle: FakeWorker, timeout: float) -> Heartbeat:
        await self._reach(handle, timeout, hangs=True)
        return self._heartbeat(handle)

    async def final_state(self, handle: FakeWorker, timeout: float) -> bytes:
        await self._reach(handle, timeout)
        return b"fake-state"

    async def load_checkpoint(self, handle: FakeWorker, data: bytes, timeout: float | None = None) -> int:
        await self._reach(handle, timeout)
        return 0

    def _probed(self, handle: FakeWorker, answer: Callable[[], Any]) -> tuple[Any | None, str | None]:
        """A probe's answer: (None, why) for a dead worker, (None, None) for a hung one."""
        if not handle.alive:
            return None, f"{handle.name} died"
        if handle.hung:
            return None, None
        return answer(), None

    async def probe_heartbeat(self, handle: FakeWorker, timeout: float) -> tuple[Heartbeat | None, str | None]:
        return self._probed(handle, lambda: self._heartbeat(handle))

    async def status(self, handle: FakeWorker, timeout: float = 5.0) -> WorkerStatus | None:
        return self._probed(handle, lambda: self._status(handle))[0]

    async def records_after(self, handle: FakeWorker, step: int, timeout: float = 5.0) -> tuple[dict, ...] | None:
        return self._probed(handle, lambda: tuple(r for r in handle.kept if r["step"] > step))[0]

    async def evaluate_state(self, handle: FakeWorker, blob: bytes, timeout: float = 5.0) -> dict | None:
        return self._probed(handle, lambda: {})[0]

    async def watch(self, handle: FakeWorker) -> tuple[str, RunOutcome]:
        if handle.ended is None:
            handle.ended = asyncio.get_running_loop().create_future()
        # a watcher cancelled (its coordinator gone) leaves the worker's end to the next one, as a Ray call does
        return await asyncio.shield(handle.ended)

    def kill(self, handle: FakeWorker | None) -> None:
        if handle is None or not handle.alive:
            return
        self.kills += 1
        handle.alive = False
        handle.end("died", RunOutcome(False, error="killed by the coordinator"))

    def kill_process(self, node: str, pid: int) -> None:
        self.processes_killed.append((node, pid))

    def process_state(self, node: str, pid: int) -> str | None:
        return self.processes.get(pid)

    def watch_exit(self, node: str, pid: int, lifeline: dict | None, on_end: Callable[[], None],
                   wanted: Callable[[], bool]) -> bool:
        if not lifeline or self.processes.get(pid) is None:  # one on this node, with a lifeline
            return False
        self.exit_watches[pid] = (on_end, wanted)
        return True

    def actor_id(self, handle: Any) -> str:
        return f"fake{handle.pid}" if handle is not None else ""

    def is_placed(self, handle: Any) -> bool | None:
        if handle is None:  # not created yet (as Ray's: no process)
            return False
        return handle.ready_gate is None or handle.ready_gate.is_set()

    def metric(self, metric: Any, defaults: dict[str, str]) -> FakeMetric:
        made = self.metrics[metric.name] = FakeMetric(metric.kind)
        return made

    def free_resources(self) -> dict:
        return {"CPU": 0.0} if self.unplaced else dict(self.free)
