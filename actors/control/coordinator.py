"""The coordinator actor: a thin shell over its parts (actors/control/).

One per job run, named `<job name>` in the namespace `orchestrator` so that any process can
attach. It builds the parts, takes the calls of drivers (status, scale, stop), of workers (reports,
epoch agreements, checkpoints, failed collectives) and of the parameter server, and hands each to
the part that owns it:

- `JobStateMachine` (control/job_state.py): the job's state, its cause, the stop decided, its times;
- `Plans` (control/plans.py): plans, reshapes, convergence on the target count, re-forms, scales,
  the policy trial's switches; `Publisher` (control/publisher.py) hands each plan out;
- `Records` (control/records.py): records accepted into history, and what a newest one closes;
- `Lifecycle` (control/lifecycle.py): the main task, from the start (or a restart's recovery) to the
  end, and the parameter server's control (server_control.py);
- `StateFile` (control/restart.py): what a restarted incarnation carries on from;
- `MembershipBook` (control/book.py): members, slots, epochs, plans, open reshapes;
- `Journal` (control/journal.py): the run directory and the progress status shows;
- `SparePool` (control/spares.py), `Launcher` (control/launcher.py) and `Admission`
  (control/admission.py): starting workers and admitting them into plans;
- `Supervisor` (control/supervisor.py): watches, heartbeats, probes and stragglers, with
  `algorithms/supervision.decide` deciding and this shell forwarding the decision (`Actions`) to the
  part that carries it out;
- `WorkerGroup` (control/workers.py): every call to Ray, replaced by a fake in unit tests;
- `RendezvousKey` (control/keys.py): the job's rendezvous key, kept for a restarted incarnation.

It is not on the per-step data path: workers report progress in batches. States (an enum in
algorithms/rules/supervision.py): STARTING -> RUNNING -> (RESHAPING -> RUNNING)* -> STOPPING ->
STOPPED / FINISHED / FAILED, with PAUSED below `workers.min`. Every transition is an event with
its reason, in `events.jsonl`.
"""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

import ray

from actors import REMOTE_HOME
from actors.control.admission import Admission
from actors.control.book import MembershipBook
from actors.control.feed import Feed
from actors.control.job_state import JobStateMachine
from actors.control.journal import Journal
from actors.control.keys import RendezvousKey
from actors.control.launcher import Launcher
from actors.control.lifecycle import Lifecycle
from actors.control.members import Member
from actors.control.plans import Plans
from actors.control.publisher import Publisher
from actors.control.records import Records
from actors.control.restart import StateFile
from actors.control.run_identity import RunIdentity
from actors.control.sequencer import Order, Sequencer
from actors.control.server_control import server_restarted
from actors.control.spares import SparePool
from actors.control.supervisor import Supervisor
from actors.control.tasks import Tasks
from actors.control.workers import PlacementWatch, RayWorkerGroup, WorkerGroup
from actors.faults import CoordinatorFaults
from actors.observe.metrics import Exporter, JobMetrics
from actors.observe.tracking import TensorBoard
from actors.plan import ParentWatch, Plan, Progress
from actors.runs import checkpoints, credentials, runfiles
from actors.runs.mirror import RunMirror, claim_incarnation
from actors.runs.storage import run_storage
from algorithms.rules.kinds import PolicyTraits
from algorithms.rules.supervision import JobState, JobView, MemberState
from core.schema import JobConfig, parse

MAX_RESTARTS = 5
"""How often Ray restarts a coordinator whose process dies; each restart carries on from the run
directory and the live workers (a new incarnation)."""
FEED_WAIT_S = 30.0
"""The longest a driver's long poll waits before it is answered anyway (it then asks again)."""
WORKER_STARTS_PER_INCARNATION = 1_000_000
"""Coordinator incarnation n numbers its worker starts from n x this: the count the state file holds can
lag the dead incarnation (a store one upload behind), and a worker incarnation number must never repeat
(the parameter server and the lease dispenser fence a slot by it)."""
S = MemberState


class Coordinator:
    """The coordinator actor: builds its parts and hands each call to the part that owns it."""

    __module__ = REMOTE_HOME  # orchestrator/remote.py: Ray imports it from there

    def __init__(self, config: dict, run_id: str, run_dir: str, incarnation: int = 0, search_path: tuple[str, ...] = (),
                 resume_from: str | None = None, owner_job: str | None = None,
                 started_at: float | None = None, group: WorkerGroup | None = None) -> None:
        self.cfg = cfg = parse(JobConfig, config)
        path, name, started = Path(run_dir), cfg.name, started_at or time.time()
        self.group = group or RayWorkerGroup(cfg)
        self._parent = ParentWatch()
        self.keys = RendezvousKey(path, self.group, f"{name}/{run_id}", cfg.comm.sign_rendezvous)
        secret = secrets.token_bytes(32) if cfg.comm.sign_rendezvous else b""  # a restarted one keeps the live workers'
        self.algorithm = PolicyTraits(cfg.sync.policy)
        """What the coordinator needs of the policy: its kind's answers (algorithms/rules/kinds.py)."""
        self.tasks = Tasks()
        """Every task the coordinator's parts start but its main task: ended when it closes (actors/control/tasks.py)."""
        self.group.setup(path, cfg.log_level)
        credentials.receive(self.group.recall_secret(credentials.kv_key(name, run_id)))  # storage keys, if any
        storage, run_key = run_storage(cfg.storage, path, cfg.storage_options)
        if storage.remote:  # above every incarnation the store has seen, a zombie's included (actors/runs/fencing.py)
            incarnation = claim_incarnation(storage, run_key, path, incarnation)
        mirror = RunMirror(storage, run_key, path, incarnation) if storage.remote else None
        self.journal = Journal(path, cfg.checkpoint.keep, storage, run_key, mirror, restarted=self.group.reconstructed,
                               store_delay_s=cfg.faults.checkpoint_store_s,
                               fingerprint=checkpoints.fingerprint(cfg.workload.factory, cfg.workload.params),
                               store_fails_until=started + cfg.faults.checkpoint_fail_s
                               if cfg.faults.checkpoint_fail_s else 0.0, tasks=self.tasks)
        self.metrics = JobMetrics(Exporter(name, run_id, cfg.sync.policy, cfg.tracking.metrics, self.group.metric),
                                  self.algorithm.kind.traffic, lambda: self.journal.step, cfg.tracking.per_worker_metrics)
        self.journal.listeners.append(self.metrics)
        self.feed = Feed()
        """Wakes the drivers' long polls (`watch_feed`) on each event and each newest record."""
        self.journal.listeners.append(self.feed)
        self.book = MembershipBook(cfg, run_id, self.algorithm.kind)
        self.faults = CoordinatorFaults(
            cfg.faults, set(runfiles.read_json(path / "coordinator_faults_fired.json", [])),
            lambda fired: self.journal.write_json("coordinator_faults_fired.json", sorted(fired)),
            lambda reason: self._note("fault", reason, fired_at=time.time()))
        saved = self.journal.load_state() if self.group.reconstructed else None
        if saved is not None:
            incarnation = max(incarnation, saved["incarnation"] + 1)
            secret = self.keys.recall(saved, secret)
            self.book.load(saved)
        else:
            self.keys.keep(secret)
        self.run = RunIdentity(cfg, config, run_id, path, incarnation, tuple(search_path), secret, owner_job, resume_from)
        self.sequencer = Sequencer(trust_first=saved is not None, gave_up=lambda sender, seq: self._note(
            "info", f"message {seq} from {sender} waited {self.sequencer.wait_s:g}s for an earlier one that never came "
                    f"(a call lost, as with a restarting coordinator): it ran without it", sender=sender, seq=seq))
        """Runs each worker's messages in the order it sent them (Ray does not, for an asyncio actor); a restarted
        incarnation trusts the first number it hears from each (the live workers numbered theirs to the dead one)."""
        self.job = JobStateMachine(name, started, self.journal.event, self._persist,
                                   lambda state, number: self.state_file.ended(state, number), saved)
        self.history = self.journal.open_history(self.algorithm.reporter, self.journal.step, self.book.live)
        self._build(saved)
        if cfg.tracking.tensorboard:
            self.journal.listeners.append(TensorBoard.for_run(cfg.tracking.tensorboard, path, name, run_id,
                                                              self.history.reporter.each_member_reports, incarnation))
        if saved is not None and self.job.state == JobState.RUNNING:  # status() never says RUNNING before re-attaching
            self.job.transition(JobState.RESHAPING, f"coordinator restarted as incarnation {incarnation}: re-attaching workers")
        else:
            self._persist()

    def _build(self, saved: dict | None) -> None:
        """The parts that start, admit and supervise workers, and the lifecycle that drives them. A part that
        calls one built after it gets a method of this shell, which forwards the call."""
        cfg, run, w, kind = self.cfg, self.run, self.cfg.workers, self.algorithm.kind
        placement = PlacementWatch(self.group, w.cpus, w.gpus, w.pause_after_s)
        """Tells a joiner or a spare that Ray cannot place (an event, and in `status`)."""
        self.spares = SparePool(w.spares, self.group, run.prefix, lambda slot: run.spec(slot, 0), self._persist,
                                self.journal.wait_saved, self.journal.event, wanted=self.job.may_start,
                                settled=lambda: not (self.book.pending or self.book.slots_in(S.STARTING, S.READY)),
                                started=(saved or {}).get("started_spares", 0), tasks=self.tasks, placement=placement)
        self.publisher = Publisher(self.book, self.group, kind, run.incarnation, lambda: self.lifecycle.server,
                                   self._persist, lambda version, sent: self.faults.maybe_die("publish", version, sent))
        self.supervisor = Supervisor(cfg, self.book, self.group, self, self.journal.event, kind,
                                     lambda: self.journal.step, tasks=self.tasks)
        trial = cfg.policy_trial if cfg.policy_trial and saved is None and not cfg.policy_trial.get("resumed") else None
        self.plans = Plans(cfg, self.book, self.publisher, self.job, self.history, self.feed, self.spares, self.group,
                           self.journal.event, self._spawn, self._persist, self.tasks, trial)
        self.admission = Admission(self.book, self.journal, self.journal.checkpoints, self.group, kind, w.min,
                                   lambda: self.job.state, self.job.may_start, lambda: self.history, self.plans.reshape,
                                   self.supervisor.run, self._fail, tasks=self.tasks)
        self.launcher = Launcher(self.book, self.spares, self.group, run.prefix, run.spec, self.journal.fired,
                                 self.journal.event, lambda: self.job.state, self.job.may_start, self.admission.request,
                                 started=max((saved or {}).get("started_workers", 0),
                                             run.incarnation * WORKER_STARTS_PER_INCARNATION), tasks=self.tasks,
                                 placement=placement, fail=self._fail)
        self.state_file = StateFile(run, self.journal, self.book, self.job, self.launcher, self.spares, self.group, saved)
        self.records = Records(cfg, self.journal, self.history, self.book, self.job, self.admission, self.plans,
                               self.faults, self.tasks, self.supervisor.stop, lambda count: self.scale(count, wait=False),
                               self.end)
        self.lifecycle = Lifecycle(run, self.algorithm, self.group, self.journal, self.history, self.book, self.job,
                                   self.state_file, self.launcher, self.spares, self.supervisor, self.plans, self.records,
                                   self.metrics, self.faults, self.keys, self._parent, self.tasks)

    def _note(self, kind: str, reason: str, **detail: Any) -> None:
        """An event, for the parts that tell the journal and never read the event back."""
        self.journal.event(kind, reason, **detail)

    def _persist(self) -> int:
        return self.state_file.save()

    def _spawn(self, slots: list[str], reason: str, detector: str) -> None:
        self.launcher.spawn(slots, reason, detector)

    async def _fail(self, reason: str, detail: dict) -> None:
        await self.end(JobState.FAILED, reason, detail)

    # ------------------------------------------------------------------ calls from drivers
    async def start(self) -> dict:
        if self.lifecycle.main_task is None:
            self.supervisor.start()
            self.plans.start()
            self.lifecycle.start()
        return {"node": self.group.node_ip, "pid": os.getpid()}

    async def status(self) -> dict:
        return self.lifecycle.status().to_dict()

    async def config(self) -> dict:
        """The job's resolved config (a driver on a node without the run folder attaches with it)."""
        return dict(self.run.config)

    async def list_events(self) -> list[dict]:
        return [e.to_dict() for e in self.journal.events]

    async def watch_feed(self, seen: int, step: int, timeout: float) -> dict:
        """A long poll (`ElasticJob.wait_for`): answers once events numbered `seen` or later exist, the job's
        step is past `step`, or the job has ended; at the latest after `timeout` (at most FEED_WAIT_S) seconds."""
        await self.feed.wait(lambda: self.journal.count > seen or self.journal.step > step or self.job.state.terminal,
                             min(timeout, FEED_WAIT_S))
        events, complete = self.journal.since(seen)
        return {"count": self.journal.count, "events": events, "complete": complete, "step": self.journal.step,
                "state": self.job.state.value}

    async def request_stop(self, reason: str = "stop requested") -> dict:
        """Graceful stop: every member stops at the same committed step; state STOPPED."""
        await self.supervisor.stop("STOPPED", reason)
        return self.lifecycle.status().to_dict()

    async def scale(self, count: int, wait: bool = True) -> dict:
        """Grow or shrink to `count` workers without restarting anyone. Joiners are made ready first (a
        hot spare, or a new actor) and admitted by a plan; members over the count leave by a plan, and
        joiners not yet admitted are dropped first. With `wait`, returns once that is done (the plan of
        `count` members published), or once every joiner still missing waits for room Ray has not got
        (each one's cause in the status says what it lacks; it joins when placed), or once the job takes
        another course (another scale, a stop, its end), at most SCALE_WAIT_S. Refused (ValueError, the
        reason in one line) where nothing can be done: a count outside [min, max] or whose shares would be
        empty, a job that is not running or is stopping, no free slot."""
        await self.state_file.recovered.wait()
        await self.plans.scale(count, wait)
        return self.lifecycle.status().to_dict()

    async def release(self) -> None:
        """Let a terminal coordinator exit now (the driver has read the result)."""
        self.lifecycle.release()

    # ------------------------------------------------------------------ calls from workers
    async def report(self, progress: Progress, order: Order | None = None) -> None:
        await self.sequencer.turn(order)
        if self.faults.die_on_report and progress.records:
            self.faults.maybe_die("stop")
        member = self.book.members.get(progress.slot)
        if member is not None:
            self.supervisor.progress(member, progress.mark, progress.compute_s)
        self.metrics.steps(progress.step_s)
        self.records.report(progress.records)

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
        await self.records.agreed(epoch, step, records)

    async def save_checkpoint(self, step: int, blob: bytes, order: Order | None = None) -> None:
        await self.sequencer.turn(order)
        self._parent.exit_if_orphaned()
        await self.journal.checkpoints.save(step, blob)

    async def collective_failed(self, slot: str, epoch: int, error: str, order: Order | None = None) -> None:
        await self.sequencer.turn(order)
        await self.supervisor.collective_failed(slot, epoch, error)

    # ------------------------------------------------------------------ calls from the parameter server
    async def server_report(self, records: tuple[dict, ...], summary: dict) -> None:
        """The parameter server applied these versions (history records) and now counts `summary`."""
        server = self.lifecycle.server
        if server is not None:
            records = await server.take_report(records, summary, self.history.written_step)
        for record in records:
            self.records.accept(record)

    async def server_barrier(self, index: int, members: tuple[str, ...], intervals: dict[str, list[float]]) -> None:
        """elastic_bsp: round `index` began at the server; ZipLine places its barrier (server_control.py)."""
        server = self.lifecycle.server
        if server is not None:
            server.place_barrier(index, members, intervals)

    async def server_restarted(self, resumed: int, incarnation: int, snapshot: str | None) -> None:
        """Ray restarted the parameter server from its snapshot at version `resumed` (server_control.py)."""
        server_restarted(self.cfg, self.algorithm.kind, self.lifecycle.server, self.book, self.history, self.journal,
                         resumed, incarnation, snapshot)

    # ------------------------------------------------------------------ what decisions call (Actions)
    @property
    def state(self) -> JobState:
        return self.job.state

    @property
    def stop_kind(self) -> str | None:
        return self.job.stop_kind

    def view(self) -> JobView:
        return self.book.view(self.job.state, self.job.stop_kind, None if self.algorithm.kind.runs_server
                              else self.journal.checkpoints.restorable())

    def transition(self, to: JobState, reason: str) -> None:
        self.job.transition(to, reason)

    def set_cause(self, cause: str | None) -> None:
        self.job.set_cause(cause)

    def reshape(self, members: tuple[str, ...], reason: str, detector: str, detected_at: float,
                new_epoch: bool = False, *, aborts: bool = False) -> Plan:
        return self.plans.reshape(members, reason, detector, detected_at, new_epoch, aborts=aborts)

    def publish(self, members: tuple[str, ...], reason: str) -> Plan:
        return self.plans.publish(members, reason)

    def reform(self, reason: str) -> None:
        self.plans.reform(reason)

    def abort_epoch(self, reason: str) -> None:
        self.publisher.abort_epoch(reason)

    def begin_stop(self, kind: str, cause: str, stop_step: int) -> None:
        self.lifecycle.begin_stop(kind, cause, stop_step)

    def restore_on_admit(self) -> None:
        self.admission.restore_on_admit()

    def replace(self, slot: str) -> None:
        self.plans.replace(slot)

    async def slot_failed(self, member: Member, phase: str, cause: str) -> bool:
        return await self.launcher.slot_failed(member, phase, cause)

    async def departure_settled(self) -> None:
        await self.launcher.departure_settled()

    async def end(self, state: JobState, reason: str, detail: dict | None = None, quiet: bool = False) -> None:
        await self.lifecycle.end(state, reason, detail, quiet)

    async def stop_now(self, kind: str | None, state: JobState, reason: str) -> None:
        self.job.decide_stop(kind)
        await self.lifecycle.end(state, reason, quiet=True)

    async def finish(self) -> None:
        await self.lifecycle.finish()


CoordinatorActor = ray.remote(num_cpus=0)(Coordinator)
