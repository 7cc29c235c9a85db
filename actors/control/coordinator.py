"""The coordinator actor: a thin shell over its components (actors/control/).

One per job run, named `<job name>` in the namespace `orchestrator` so that any process can
attach. It takes the calls of drivers (status, scale, stop) and of workers (reports, epoch
agreements, checkpoints, failed collectives), runs the job's state machine, and wires the parts
that own the rest:

- `MembershipBook` (control/book.py): members, slots, epochs, plans, open reshapes;
- `Journal` (control/journal.py): the run directory and the progress status shows;
- `SparePool` (control/spares.py) and `Launcher` (control/launcher.py): starting workers;
- `Supervisor` (control/supervisor.py): watches, heartbeats, probes and stragglers, with
  `algorithms/supervision.decide` deciding and this shell carrying the decision out (`Actions`);
- `ServerControl` (server_control.py): the parameter server of the server kinds;
- `WorkerGroup` (control/workers.py): every call to Ray, replaced by a fake in unit tests;
- `RendezvousKey` (control/keys.py): the job's rendezvous key, kept for a restarted incarnation.

It is not on the per-step data path: workers report progress in batches. States (an enum in
algorithms/rules/supervision.py): STARTING -> RUNNING -> (RESHAPING -> RUNNING)* -> STOPPING ->
STOPPED / FINISHED / FAILED, with PAUSED below `workers.min`. Every transition is an event with
its reason, in `events.jsonl`.

The class is built in layers: `CoordinatorBase` (control/base.py) wires the components and holds the
plans, history and status; `Lifecycle` (control/lifecycle.py) is the main task, from the start (or a
restart's recovery) to the end; `Coordinator`, here, is the shell's surface: the calls of drivers,
workers and the parameter server, and what the supervisor's decisions call (`Actions`).
"""
from __future__ import annotations

import asyncio
import os
import time

import ray

from actors import REMOTE_HOME
from actors.control.journal import restorable_step
from actors.control.lifecycle import Lifecycle
from actors.control.members import Member
from actors.control.sequencer import Order
from actors.control.server_control import server_restarted
from actors.plan import Progress
from algorithms.rules.membership import share_refusal
from algorithms.rules.supervision import JobState, JobView, MemberState

MAX_RESTARTS = 5
"""How often Ray restarts a coordinator whose process dies; each restart carries on from the run
directory and the live workers (a new incarnation)."""
FEED_WAIT_S = 30.0
"""The longest a driver's long poll waits before it is answered anyway (it then asks again)."""
SCALE_WAIT_S = 240.0
"""The longest `scale` waits for its joiners (a driver's call waits 300 s)."""
FORCE_STOP_AFTER_S = 10.0
"""A stop's grace beyond `comm.timeout_s`: members that have not stopped by then are killed."""


class Coordinator(Lifecycle):
    __module__ = REMOTE_HOME  # orchestrator/remote.py: Ray imports it from there

    # ------------------------------------------------------------------ calls from drivers
    async def start(self) -> dict:
        if self._main_task is None:
            self.supervisor.start()
            self._released, self._reshape_lock = asyncio.Event(), asyncio.Lock()
            self._main_task = asyncio.get_running_loop().create_task(self._main())
        return {"node": self.group.node_ip, "pid": os.getpid()}

    async def status(self) -> dict:
        return self._status().to_dict()

    async def config(self) -> dict:
        """The job's resolved config (a driver on a node without the run folder attaches with it)."""
        return dict(self.config_dict)

    async def list_events(self) -> list[dict]:
        return [e.to_dict() for e in self.journal.events]

    async def watch_feed(self, seen: int, step: int, timeout: float) -> dict:
        """A long poll (`ElasticJob.wait_for`): answers once events numbered `seen` or later exist, the job's
        step is past `step`, or the job has ended; at the latest after `timeout` (at most FEED_WAIT_S) seconds."""
        await self.feed.wait(lambda: self.journal.count > seen or self.journal.step > step or self.state.terminal,
                             min(timeout, FEED_WAIT_S))
        events, complete = self.journal.since(seen)
        return {"count": self.journal.count, "events": events, "complete": complete, "step": self.journal.step,
                "state": self.state.value}

    async def request_stop(self, reason: str = "stop requested") -> dict:
        """Graceful stop: every member stops at the same committed step; state STOPPED."""
        await self.supervisor.stop("STOPPED", reason)
        return self._status().to_dict()

    async def scale(self, count: int, wait: bool = True) -> dict:
        """Grow or shrink to `count` workers without restarting anyone. Joiners are made ready first (a
        hot spare, or a new actor) and admitted by a plan; members over the count leave by a plan, and
        joiners not yet admitted are dropped first. With `wait`, returns once that is done (the plan of
        `count` members published), or once every joiner still missing waits for room Ray has not got
        (each one's cause in the status says what it lacks; it joins when placed), or once the job takes
        another course (another scale, a stop, its end), at most SCALE_WAIT_S. Refused (ValueError, the
        reason in one line) where nothing can be done: a count outside [min, max] or whose shares would be
        empty, a job that is not running or is stopping, no free slot."""
        await self._recovered.wait()
        w = self.cfg.workers
        high = w.max if w.max is not None else w.count  # a parsed config's max is set (count by default)
        if not w.min <= count <= high:
            raise ValueError(f"scale: {count} workers is outside [workers.min, workers.max] = [{w.min}, {w.max}]")
        refusal = share_refusal(count, self.cfg.workload.batch_size, w.count, w.batch_mode, self.book.batch_norm)
        if refusal is not None:
            raise ValueError(f"scale: {refusal}")
        if not self.state.active or self.stop_kind is not None:
            raise ValueError(f"scale: the job is {'stopping' if self.state.active else self.state.value}; only a "
                             f"running or paused job can be scaled")
        previous, self.book.target_count = self.book.target_count, count
        self._persist()
        done = await self._converge(f"scale to {count} requested", "scale request")
        if done is None:
            raise ValueError(f"scale: the job is {self.state.value} and stopping; it takes no new member")
        if done.missing and not done.start:
            self.book.target_count = previous
            self._persist()
            raise ValueError(f"scale: no free slot for {done.missing} more worker(s): slots "
                             f"{', '.join(sorted(self.book.retired))} were retired by workers.failure_budget "
                             f"({w.failure_budget} failures)")
        if wait:
            await self.feed.wait(lambda: self._scaled(count), SCALE_WAIT_S)
        return self._status().to_dict()

    def _scaled(self, count: int) -> bool:
        """Whether a scale to `count` did what can be done now: no joiner is still coming, or each one that
        is waits for room Ray has not got; or the job took another course (another target, a stop, its end)."""
        if self.book.target_count != count or not self.state.active or self.stop_kind is not None:
            return True
        return all(self.book.members[s].unplaced for s in self.book.slots_in(MemberState.STARTING, MemberState.READY))

    async def release(self) -> None:
        """Let a terminal coordinator exit now (the driver has read the result)."""
        if self._released is not None:
            self._released.set()

    # ------------------------------------------------------------------ calls from workers
    async def report(self, progress: Progress, order: Order | None = None) -> None:
        await self.sequencer.turn(order)
        if self.faults.die_on_report and progress.records:
            self.faults.maybe_die("stop")
        member = self.book.members.get(progress.slot)
        if member is not None:
            self.supervisor.progress(member, progress.mark, progress.compute_s)
        self.metrics.steps(progress.step_s)
        with self.history.batch():
            for record in progress.records:
                try:
                    self._accept_record(record)
                except Exception as err:  # noqa: BLE001 - one bad record must not drop the rest
                    self.journal.event("info", f"could not record step {record.get('step')}: {type(err).__name__}: {err}")

    async def fault_fired(self, index: int, slot: str, step: int, phase: str, order: Order | None = None) -> None:
        await self.sequencer.turn(order)
        self.journal.fault_fired(index)
        self.journal.event("fault", f"injected fault #{index} fires in {slot} at step {step} during {phase}",
                           slot=slot, step=step, phase=phase, fired_at=time.time())

    async def samples_skipped(self, slot: str, step: int, ids: list[int], reason: str, order: Order | None = None) -> None:
        """`workload.on_bad_sample: skip`: a member trained its share of step `step` without these samples."""
        await self.sequencer.turn(order)
        self.journal.samples_skipped(slot, step, ids, reason)

    async def transport_fallback(self, slot: str, epoch: int, group: str, reason: str, order: Order | None = None) -> None:
        """Rank `slot` of `group`: its members all run on one node but all-reduce through gloo, and `reason`
        says why (shared memory was unavailable to one of them: actors/transport/shm.py)."""
        await self.sequencer.turn(order)
        self.journal.event("transport", reason, slot=slot, group=group, membership_epoch=epoch)

    async def state_received(self, slot: str, epoch: int, source: str, step: int, order: Order | None = None) -> None:
        """A member that was behind loaded the state broadcast by `source` at epoch start. When the
        epoch's reshape event already went out (the kinds whose other members train on), an event of
        its own says so."""
        await self.sequencer.turn(order)
        if not self.book.state_received(slot, epoch, source, step):
            self.journal.event("info", f"{slot} received the state of {source} at step {step} (membership epoch {epoch})",
                               slot=slot, state_source={"source": source, "step": step}, membership_epoch=epoch)

    async def epoch_agreed(self, epoch: int, step: int, records: tuple[dict, ...], order: Order | None = None) -> None:
        """Rank 0 of `epoch`: its members agreed that `step` is the newest committed step; `records`
        are those it keeps after the plan's history step (what a departed rank 0 never reported)."""
        await self.sequencer.turn(order)
        for record in records:
            self._accept_record(record)
        if step < self.history.written_step and epoch == self.book.epoch and not self.state.terminal:
            # Below a step history holds as final: none of the epoch's members holds the committed
            # state (joiners alone would start over). Never train on from there: end, resumable.
            await self.end(JobState.FAILED, f"the members of membership epoch {epoch} agreed on step {step}, below the "
                                            f"committed step {self.history.written_step}: none of them holds the "
                                            f"committed state (resume with --resume)")
            return
        self.history.agreed(epoch, step)
        self.journal.step = self.history.step()

    async def save_checkpoint(self, step: int, blob: bytes, order: Order | None = None) -> None:
        await self.sequencer.turn(order)
        self._parent.exit_if_orphaned()
        await self.journal.save_checkpoint(step, blob)

    async def collective_failed(self, slot: str, epoch: int, error: str, order: Order | None = None) -> None:
        await self.sequencer.turn(order)
        await self.supervisor.collective_failed(slot, epoch, error)

    # ------------------------------------------------------------------ calls from the parameter server
    async def server_report(self, records: tuple[dict, ...], summary: dict) -> None:
        """The parameter server applied these versions (history records) and now counts `summary`."""
        if self.server is not None:
            records = await self.server.take_report(records, summary, self.history.written_step)
        for record in records:
            self._accept_record(record)

    async def server_barrier(self, index: int, members: tuple[str, ...], intervals: dict[str, list[float]]) -> None:
        """elastic_bsp: round `index` began at the server; ZipLine places its barrier (server_control.py)."""
        if self.server is not None:
            self.server.place_barrier(index, members, intervals)

    async def server_restarted(self, resumed: int, incarnation: int, snapshot: str | None) -> None:
        """Ray restarted the parameter server from its snapshot at version `resumed` (server_control.py)."""
        server_restarted(self.cfg, self.algorithm.kind, self.server, self.book, self.history, self.journal,
                         resumed, incarnation, snapshot)

    # ------------------------------------------------------------------ what decisions call (Actions)
    def view(self) -> JobView:
        return self.book.view(self.state, self.stop_kind, None if self.algorithm.kind.runs_server
                              else restorable_step(self.journal.checkpoint, self.journal.pending_checkpoint()))

    def set_cause(self, cause: str | None) -> None:
        self.cause = cause

    def begin_stop(self, kind: str, cause: str, stop_step: int) -> None:
        self.stop_kind, self.cause, self.book.stop_step = kind, cause, stop_step
        if self.server is not None:
            self.server.close(cause)  # members stop at their next pull
        self.tasks.spawn(self._force_stop_after(self.cfg.comm.timeout_s + FORCE_STOP_AFTER_S))
        self.faults.die_on_report = True

    def restore_on_admit(self) -> None:
        pending = self.journal.pending_checkpoint()
        # one being stored (the first, or one newer than the last stored): the admission waits for it
        self.admission.restore = self.journal.checkpoint if pending is None else (pending, "")

    def replace(self, slot: str) -> None:
        self.tasks.spawn(self._converge(f"replace {slot}", "replacement"))

    async def slot_failed(self, member: Member, phase: str, cause: str) -> bool:
        return await self.launcher.slot_failed(member, phase, cause)

    async def departure_settled(self) -> None:
        await self.launcher.departure_settled()


CoordinatorActor = ray.remote(num_cpus=0)(Coordinator)
