"""The coordinator's parts, wired, and what the rest of it builds on.

`CoordinatorBase.__init__` builds the components of actors/control/ (see actors/control/coordinator.py's
docstring for who owns what) and the fields they share. On it: the state file a restarted
incarnation carries on from, the job's transitions, plans (publish, reshape, converge, re-form,
the trial's policy switch), records accepted into history (and what they close: reshapes, the
target), and the job's status. Its subclasses: `Lifecycle` (actors/control/lifecycle.py: the main
task and the end) and `Coordinator` (actors/control/coordinator.py: the calls of drivers, workers and the
parameter server).
"""
from __future__ import annotations

import asyncio
import os
import secrets
import time
from abc import abstractmethod
from pathlib import Path
from typing import Any

from actors.control.admission import Admission
from actors.control.book import Convergence, MembershipBook
from actors.control.feed import Feed
from actors.control.journal import Journal
from actors.control.keys import RendezvousKey
from actors.control.launcher import Launcher
from actors.control.members import Member
from actors.control.publisher import Publisher
from actors.control.sequencer import Sequencer
from actors.control.server_control import ServerControl
from actors.control.spares import SparePool
from actors.control.supervisor import Actions, Supervisor
from actors.control.tasks import Tasks
from actors.control.trial import Trial
from actors.control.workers import PlacementWatch, RayWorkerGroup, WorkerGroup
from actors.faults import CoordinatorFaults
from actors.observe.metrics import Exporter, JobMetrics
from actors.observe.tracking import TensorBoard
from actors.plan import ParentWatch, Plan, WorkerSpec
from actors.runs import checkpoints, credentials, runfiles
from actors.runs.mirror import RunMirror, claim_incarnation
from actors.runs.storage import run_storage
from algorithms.rules.kinds import PolicyTraits
from algorithms.rules.supervision import JOB_TRANSITIONS, JobState, MemberState, check_transition
from algorithms.rules.topologies import topology_status
from core.schema import JobConfig, JobStatus, parse

WORKER_STARTS_PER_INCARNATION = 1_000_000
"""Coordinator incarnation n numbers its worker starts from n x this: the count the state file holds can
lag the dead incarnation (a store one upload behind), and a worker incarnation number must never repeat
(the parameter server and the lease dispenser fence a slot by it)."""
S = MemberState


class CoordinatorBase(Actions):
    """The coordinator's components and shared fields; the job's plans, history and status."""

    def __init__(self, config: dict, run_id: str, run_dir: str, incarnation: int = 0, search_path: tuple[str, ...] = (),
                 resume_from: str | None = None, owner_job: str | None = None,
                 started_at: float | None = None, group: WorkerGroup | None = None) -> None:
        self.cfg: JobConfig = parse(JobConfig, config)
        self.config_dict, self.search_path, self.resume_from, self.owner_job = config, tuple(search_path), resume_from, owner_job
        self.name, self.run_id, self.run_dir, self.incarnation = self.cfg.name, run_id, Path(run_dir), incarnation
        self.prefix = f"{self.name}/{self.run_id}"
        self.group = group or RayWorkerGroup(self.cfg)
        self._parent = ParentWatch()
        self.keys = RendezvousKey(self.run_dir, self.group, f"{self.name}/{self.run_id}", self.cfg.comm.sign_rendezvous)
        self.sequencer = Sequencer(gave_up=lambda sender, seq: self._note(
            "info", f"message {seq} from {sender} waited {self.sequencer.wait_s:g}s for an earlier one that never came "
                    f"(a call lost, as with a restarting coordinator): it ran without it", sender=sender, seq=seq))
        """Runs each worker's messages in the order it sent them (Ray does not, for an asyncio actor)."""
        self.secret = secrets.token_bytes(32) if self.cfg.comm.sign_rendezvous else b""
        """The job's rendezvous key: its workers sign what they write to the group store (actors/transport/comm.py);
        a restarted coordinator keeps the one on disk (its live workers have it)."""
        self.algorithm = PolicyTraits(self.cfg.sync.policy)
        """What the coordinator needs of the policy: its kind's answers (algorithms/rules/kinds.py)."""
        self.state: JobState = JobState.STARTING
        self.cause: str | None = None
        self.stop_kind: str | None = None
        self.started_at = started_at or time.time()
        """When `start()` was called (the job's run time counts from there)."""
        self.ended_at: float | None = None
        self.running_since: float | None = None
        self.server: ServerControl | None = None
        self._last_reform = 0.0
        self._owner_checked = 0.0
        self._reshape_lock: asyncio.Lock | None = None
        self._main_task: asyncio.Task | None = None
        self._released: asyncio.Event | None = None
        self.tasks = Tasks()
        """Every task the coordinator's parts start but its main task: ended when it closes (actors/control/tasks.py)."""
        self.group.setup(self.run_dir, self.cfg.log_level)
        credentials.receive(self.group.recall_secret(credentials.kv_key(self.name, self.run_id)))  # storage keys, if any
        storage, run_key = run_storage(self.cfg.storage, self.run_dir, self.cfg.storage_options)
        if storage.remote:  # above every incarnation the store has seen, a zombie's included (actors/runs/fencing.py)
            self.incarnation = claim_incarnation(storage, run_key, self.run_dir, self.incarnation)
        mirror = RunMirror(storage, run_key, self.run_dir, self.incarnation) if storage.remote else None
        self.journal = Journal(self.run_dir, self.cfg.checkpoint.keep, storage, run_key, mirror,
                               restarted=self.group.reconstructed, store_delay_s=self.cfg.faults.checkpoint_store_s,
                               fingerprint=checkpoints.fingerprint(self.cfg.workload.factory, self.cfg.workload.params),
                               store_fails_until=self.started_at + self.cfg.faults.checkpoint_fail_s
                               if self.cfg.faults.checkpoint_fail_s else 0.0, tasks=self.tasks)
        self.metrics = JobMetrics(Exporter(self.name, run_id, self.cfg.sync.policy, self.cfg.tracking.metrics,
                                           self.group.metric), self.algorithm.kind.traffic, lambda: self.journal.step,
                                  self.cfg.tracking.per_worker_metrics)
        self.journal.listeners.append(self.metrics)
        self.feed = Feed()
        """Wakes the drivers' long polls (`watch_feed`) on each event and each newest record."""
        self.journal.listeners.append(self.feed)
        self.book = MembershipBook(self.cfg, run_id, self.algorithm.kind)
        self.faults = CoordinatorFaults(
            self.cfg.faults, set(runfiles.read_json(self.run_dir / "coordinator_faults_fired.json", [])),
            lambda fired: self.journal.write_json("coordinator_faults_fired.json", sorted(fired)),
            lambda reason: self._note("fault", reason, fired_at=time.time()))
        self._saved: dict | None = self._load_saved() if self.group.reconstructed else None
        if self._saved is None:
            self.keys.keep(self.secret)
        w = self.cfg.workers
        placement = PlacementWatch(self.group, w.cpus, w.gpus, w.pause_after_s)
        """Tells a joiner or a spare that Ray cannot place (an event, and in `status`)."""
        self.spares = SparePool(w.spares, self.group, self.prefix, lambda slot: self._spec(slot, 0),
                                self._persist, self.journal.wait_saved, self.journal.event,
                                wanted=self._may_start,
                                settled=lambda: not (self.book.pending or self.book.slots_in(S.STARTING, S.READY)),
                                started=(self._saved or {}).get("started_spares", 0), tasks=self.tasks,
                                placement=placement)
        self.publisher = Publisher(self.book, self.group, self.algorithm.kind, self.incarnation,
                                   lambda: self.server, self._persist,
                                   lambda version, sent: self.faults.maybe_die("publish", version, sent))
        self.admission = Admission(self.book, self.journal, self.group, self.algorithm.kind, self.cfg.workers.min,
                                   lambda: self.state, self._may_start, lambda: self.history, self.reshape,
                                   self._start_run, lambda reason, detail: self.end(JobState.FAILED, reason, detail),
                                   tasks=self.tasks)
        self.launcher = Launcher(self.book, self.spares, self.group, self.prefix, self._spec,
                                 self.journal.fired, self.journal.event, lambda: self.state, self._may_start,
                                 self.admission.request,
                                 started=max((self._saved or {}).get("started_workers", 0),
                                             self.incarnation * WORKER_STARTS_PER_INCARNATION), tasks=self.tasks,
                                 placement=placement, fail=lambda reason, detail: self.end(JobState.FAILED, reason, detail))
        self.trial: Trial | None = None
        """`sync.auto`'s online trial (actors/control/trial.py), on the first incarnation only."""
        if self.cfg.policy_trial and self._saved is None and not self.cfg.policy_trial.get("resumed"):
            self.trial = Trial(self.cfg.policy_trial, self._switch_policy, self._note,
                               lambda: not self.book.pending and self.stop_kind is None and self.state == JobState.RUNNING)
        self.supervisor = Supervisor(self.cfg, self.book, self.group, self, self.journal.event, self.algorithm.kind,
                                     lambda: self.journal.step, tasks=self.tasks)
        self._recovered = asyncio.Event()
        """Set once a restarted incarnation has re-attached its workers (at once for the first one):
        `scale` waits for it, since Ray may hand a restarted coordinator a call the dead one had taken."""
        if self._saved is None:
            self._recovered.set()
        else:
            self.group.start_self(self.name, self.cfg.ray.namespace)  # nobody else will
            if self.algorithm.kind.runs_server:  # detached: it trained on without us
                self.server = ServerControl.attach(self.cfg, self.run_id)
        self.history = self.journal.open_history(self.algorithm.reporter, self.journal.step, self.book.live)
        if self.cfg.tracking.tensorboard:
            self.journal.listeners.append(TensorBoard.for_run(self.cfg.tracking.tensorboard, self.run_dir, self.name,
                                                              run_id, self.history.reporter.each_member_reports, self.incarnation))
        if self._saved is not None and self.state == JobState.RUNNING:  # status() never says RUNNING before re-attaching
            self.transition(JobState.RESHAPING, f"coordinator restarted as incarnation {self.incarnation}: re-attaching workers")
        else:
            self._persist()

    def _may_start(self) -> bool:
        """Whether workers and spares start now: not once a stop is decided or the job ended."""
        return not self.state.terminal and self.stop_kind is None

    def _spec(self, slot: str, incarnation: int) -> WorkerSpec:
        return WorkerSpec(self.name, self.run_id, slot, str(self.run_dir), self.name, self.cfg.ray.namespace,
                          self.config_dict, self.search_path, incarnation=incarnation, secret=self.secret)

    # ------------------------------------------------------------------ the state file (restarts)
    def _persist(self) -> int:
        state = self.book.snapshot()
        spares = self.spares.names()
        saved = self._saved
        if saved is not None and not self._recovered.is_set():  # restarted, not re-attached: the dead incarnation's workers stand
            state["members"], spares = saved["members"], [*saved.get("spares", ()), *spares]
        state.update({"incarnation": self.incarnation, "state": self.state.value, "stop_kind": self.stop_kind,
                      "cause": self.cause, "started_at": self.started_at, "running_since": self.running_since,
                      "loss": self.journal.loss, "metrics": dict(self.journal.metrics), "spares": spares,
                      "started_workers": self.launcher.started, "started_spares": self.spares.started})
        return self.journal.save_state(state)

    def _load_saved(self) -> dict:
        saved = self.journal.load_state()
        self.incarnation = max(self.incarnation, saved["incarnation"] + 1)
        self.sequencer.trust_first = True  # the live workers numbered their messages to the dead incarnation
        self.secret = self.keys.recall(saved, self.secret)
        self.state, self.stop_kind, self.cause = JobState(saved["state"]), saved["stop_kind"], saved["cause"]
        self.running_since, self.started_at = saved["running_since"], saved["started_at"]
        self.book.load(saved)
        return saved

    def _note(self, kind: str, reason: str, **detail: Any) -> None:
        """An event, for the components that tell the journal and never read the event back."""
        self.journal.event(kind, reason, **detail)

    @abstractmethod
    async def scale(self, count: int, wait: bool = True) -> dict:
        """Grow or shrink to `count` workers (the shell's call from drivers; `faults.scales` use it too)."""

    async def _scale_by_fault(self, count: int) -> None:
        try:
            await self.scale(count, wait=False)
        except ValueError as err:  # the job ended or stops meanwhile: said, not raised into the loop
            self.journal.event("info", f"faults.scale to {count} not done: {err}")

    # ------------------------------------------------------------------ plans
    def _start_run(self, member: Member) -> None:
        self.group.run(member.handle)
        member.move(S.TRAINING)
        self.supervisor.watch(member)

    async def _converge(self, reason: str, detector: str) -> Convergence | None:
        """Start workers, drop joiners or retire members until the membership matches the target count
        (slots permitting); what was decided, or None when the job takes no change now (stopping, ended)."""
        lock = self._reshape_lock
        if lock is None:
            raise RuntimeError("the coordinator converges only once started")
        async with lock:
            if not self.state.active or self.stop_kind is not None:
                return None
            done = self.book.converge()
            if done.missing > len(done.start):
                self.journal.event("info", f"{reason}: {done.missing - len(done.start)} worker(s) short, no free slot "
                                           f"(retired: {', '.join(sorted(self.book.retired)) or 'none'})")
            if done.start:
                self.launcher.spawn(list(done.start), reason, detector)
            for slot in done.drop:  # not in any plan yet: nobody waits for them
                member = self.book.members[slot]
                member.move(S.LEFT)
                member.cause = f"no longer wanted before it joined: {reason}"
                self.book.depart(member, self.group.actor_id(member.handle))
                self.group.kill(member.handle)
            if done.drop:
                self.spares.wake()  # a dropped slot waiting for a spare stops waiting
                self.journal.event("info", f"{reason}: {', '.join(done.drop)} dropped before joining",
                                   slots=list(done.drop))
            if done.leave:
                for slot in done.leave:
                    self.book.members[slot].move(S.LEAVING)
                self.reshape(tuple(s for s in self.book.live() if s not in done.leave), reason, detector, time.time(),
                             leavers=done.leave)
            return done

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
        if self.state in (JobState.RUNNING, JobState.PAUSED):
            self.transition(JobState.RESHAPING, reason, persist=False)  # the publication below saves both
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

    def abort_epoch(self, reason: str) -> None:
        self.publisher.abort_epoch(reason)

    def _switch_policy(self, policy: dict, reason: str) -> None:
        """The trial's switch: the live members again, as a new membership epoch whose plan carries `policy`."""
        self.book.policy = policy
        self.journal.event("policy_switch", reason, policy=policy["label"])
        self.reshape(self.book.live(), reason, "policy trial", time.time(), new_epoch=True)

    def _policy_committed(self, policy: dict) -> None:
        self.book.policy = policy  # no longer fresh: later plans (a join, a re-form) carry it as is

    def transition(self, to: JobState, reason: str, persist: bool = True, **detail: Any) -> None:
        check_transition(JOB_TRANSITIONS, self.state, to, f"job {self.name}")
        self.journal.event("transition", reason, state_from=self.state.value, state_to=to.value, **detail)
        self.state = to
        if to.terminal:
            self.ended_at = time.time()
        if not persist and not to.terminal:
            return
        number = self._persist()
        if to.terminal:
            self.journal.wait_saved(number, 30)  # on disk before the driver, told the job ended, reads it
            self.group.publish_record(self.name, {"run_id": self.run_id, "run_dir": str(self.run_dir), "state": to.value,
                                                  "storage": self.cfg.storage,
                                                  "storage_options": dict(self.cfg.storage_options)})

    # ------------------------------------------------------------------ history
    def _accept_record(self, record: dict) -> None:
        newest = self.journal.offer(record)
        if not newest and not record.get("final"):
            return  # a step already in history, a stale report of a redone one, or one ahead of a gap
        if newest and self.faults.scales:
            for count in self.faults.due_scales(self.journal.step):
                self.tasks.spawn(self._scale_by_fault(count))
        if newest and self.book.pending:
            for detail in self.book.close_reshapes(record):
                self.journal.event("reshape", f"{detail['cause']}: {detail['old_members']} -> {detail['new_members']} "
                                   f"({detail['detector']}, {detail['duration_s']:.2f}s)", **detail)
            if not self.book.pending and self.state == JobState.RESHAPING:
                self.cause = None  # a pause, if there was one, is over
                self.transition(JobState.RUNNING, f"membership epoch {record.get('membership_epoch', 0)} "
                                                  f"committed step {record['step']}")
            if self.book.slots_in(S.READY):  # joiners held back for the survivors' first step
                self.tasks.spawn(self.admission.request())
        if newest and self.trial is not None:
            self.trial.offer(record, self._policy_committed)
        target, metrics = self.cfg.stop.target, self.journal.metrics
        unknown = target.unknown_in(record["metrics"]) if target is not None and record.get("metrics") else None
        if unknown is not None and self.stop_kind is None:  # at the first evaluation: no later one would have it
            self.tasks.spawn(self.supervisor.stop("FAILED", unknown))
            return
        if target is None or self.stop_kind is not None or target.metric not in metrics:
            return
        value = metrics[target.metric]
        if (value >= target.value) if target.mode == "max" else (value <= target.value):
            self.tasks.spawn(self.supervisor.stop(
                "FINISHED", f"target reached: {target.metric} = {value:.4f} ({target.mode} {target.value})"))

    # ------------------------------------------------------------------ status
    def _status(self) -> JobStatus:
        plan = self.book.plan
        return JobStatus(name=self.name, run_id=self.run_id, state=self.state.value, step=self.journal.step,
                         membership_epoch=self.book.epoch, world_size=len(plan.members) if plan else 0,
                         members=tuple(self.book.member_status(m, self.group.actor_id(m.handle))
                                       for m in self.book.members.values()),
                         loss=self.journal.loss, throughput=self.journal.throughput(),
                         tokens_per_s=self.journal.tokens_throughput(), cause=self.cause,
                         run_dir=str(self.run_dir), metrics=dict(self.journal.metrics),
                         step_metrics=dict(self.journal.step_metrics),
                         reshapes=self.journal.recent_reshapes(), departed=tuple(self.book.departed),
                         incarnation=self.incarnation, coordinator_pid=os.getpid(),
                         started_at=self.started_at, ended_at=self.ended_at,
                         stragglers={slot: round(r, 3) for slot, r in self.supervisor.stragglers.current.items()},
                         server=dict(self.server.summary, restarts=self.server.restarts) if self.server else {},
                         topology=topology_status(getattr(self.cfg.sync, "topology", None), plan), spares=self.spares.status(),
                         checkpoint=self.journal.checkpoint_status(), samples_skipped=len(self.journal.skipped))


