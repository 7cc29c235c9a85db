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
- `WorkerGroup` (control/workers.py): every call to Ray, replaced by a fake in unit tests.

It is not on the per-step data path: workers report progress in batches. States (an enum in
algorithms/supervision.py): STARTING -> RUNNING -> (RESHAPING -> RUNNING)* -> STOPPING ->
STOPPED / FINISHED / FAILED, with PAUSED below `workers.min`. Every transition is an event with
its reason, in `events.jsonl`.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import time
import traceback
from pathlib import Path
from typing import Any

import ray

from actors import REMOTE_HOME, checkpoints, runfiles
from actors.control.admission import Admission
from actors.control.book import MembershipBook
from actors.control.endings import wrap_up
from actors.control.feed import Feed
from actors.control.journal import Journal
from actors.control.launcher import Launcher, NoWorkerCanStart
from actors.control.publisher import Publisher
from actors.control.restart import reattach, records_since, resume
from actors.control.spares import SparePool
from actors.control.supervisor import Actions, Supervisor
from actors.control.trial import Trial
from actors.control.workers import RayWorkerGroup, WorkerGroup
from actors.faults import CoordinatorFaults
from actors.members import Member, log
from actors.metrics import Exporter, JobMetrics
from actors.mirror import RunMirror, claim_incarnation
from actors.plan import ParentWatch, Plan, Progress, WorkerSpec
from actors.report import draw_at_end
from actors.sequencer import Order, Sequencer
from actors.server_control import ServerControl, server_restarted
from actors.storage import run_storage
from actors.tracking import TensorBoard
from algorithms.kinds import SERVER_KINDS, PolicyTraits
from algorithms.supervision import JOB_TRANSITIONS, JobState, JobView, MemberState, check_transition, recovered_epoch
from algorithms.topologies import topology_status
from core.schema import JobConfig, JobStatus, parse

OWNER_CHECK_S = 1.0
LINGER_S = 600.0
"""A finished coordinator stays this long for `status`, unless released earlier."""
MAX_RESTARTS = 5
"""How often Ray restarts a coordinator whose process dies; each restart carries on from the run
directory and the live workers (a new incarnation)."""
WORKER_STARTS_PER_INCARNATION = 1_000_000
"""Coordinator incarnation n numbers its worker starts from n x this: the count the state file holds can
lag the dead incarnation (a store one upload behind), and a worker incarnation number must never repeat
(the parameter server and the lease dispenser fence a slot by it)."""
SECRET_FILE = "secret.key"
"""The rendezvous key in the run folder (mode 0600; never mirrored to the storage)."""
FEED_WAIT_S = 30.0
"""The longest a driver's long poll waits before it is answered anyway (it then asks again)."""
FORCE_STOP_AFTER_S = 10.0
"""A stop's grace beyond `comm.timeout_s`: members that have not stopped by then are killed."""
S = MemberState


class Coordinator(Actions):
    __module__ = REMOTE_HOME  # orchestrator/remote.py: Ray imports it from there
    def __init__(self, config: dict, run_id: str, run_dir: str, incarnation: int = 0, search_path: tuple[str, ...] = (),
                 resume_from: str | None = None, owner_job: str | None = None,
                 started_at: float | None = None, group: WorkerGroup | None = None) -> None:
        self.cfg: JobConfig = parse(JobConfig, config)
        self.config_dict, self.search_path, self.resume_from, self.owner_job = config, tuple(search_path), resume_from, owner_job
        self.name, self.run_id, self.run_dir, self.incarnation = self.cfg.name, run_id, Path(run_dir), incarnation
        self.prefix = f"{self.name}/{self.run_id}"
        self.group = group or RayWorkerGroup(self.cfg)
        self._parent = ParentWatch()
        self.sequencer = Sequencer(gave_up=lambda sender, seq: self.journal.event(
            "info", f"message {seq} from {sender} waited {self.sequencer.wait_s:g}s for an earlier one that never came "
                    f"(a call lost, as with a restarting coordinator): it ran without it", sender=sender, seq=seq))
        """Runs each worker's messages in the order it sent them (Ray does not, for an asyncio actor)."""
        self.secret = secrets.token_bytes(32) if self.cfg.comm.sign_rendezvous else b""
        """The job's rendezvous key: its workers sign what they write to the group store (actors/comm.py);
        a restarted coordinator keeps the one on disk (its live workers have it)."""
        self.algorithm = PolicyTraits(self.cfg.sync.policy)
        """What the coordinator needs of the policy: its kind's answers (algorithms/kinds.py)."""
        self.state, self.cause, self.stop_kind = JobState.STARTING, None, None
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
        self.group.setup(self.run_dir, self.cfg.log_level)
        storage, run_key = run_storage(self.cfg.storage, self.run_dir, self.cfg.storage_options)
        if storage.remote:  # above every incarnation the store has seen, a zombie's included (actors/fencing.py)
            self.incarnation = claim_incarnation(storage, run_key, self.run_dir, self.incarnation)
        mirror = RunMirror(storage, run_key, self.run_dir, self.incarnation) if storage.remote else None
        self.journal = Journal(self.run_dir, self.cfg.checkpoint.keep, storage, run_key, mirror,
                               restarted=self.group.reconstructed, store_delay_s=self.cfg.faults.checkpoint_store_s,
                               fingerprint=checkpoints.fingerprint(self.cfg.workload.factory, self.cfg.workload.params),
                               store_fails_until=self.started_at + self.cfg.faults.checkpoint_fail_s
                               if self.cfg.faults.checkpoint_fail_s else 0.0)
        self.metrics = JobMetrics(Exporter(self.name, run_id, self.cfg.sync.policy, self.cfg.tracking.metrics,
                                           self.group.metric), self.algorithm.kind, lambda: self.journal.step,
                                  self.cfg.tracking.per_worker_metrics)
        self.journal.listeners.append(self.metrics)
        self.feed = Feed()
        """Wakes the drivers' long polls (`watch_feed`) on each event and each newest record."""
        self.journal.listeners.append(self.feed)
        self.book = MembershipBook(self.cfg, run_id, self.algorithm.kind)
        self.faults = CoordinatorFaults(
            self.cfg.faults, set(runfiles.read_json(self.run_dir / "coordinator_faults_fired.json", [])),
            lambda fired: self.journal.write_json("coordinator_faults_fired.json", sorted(fired)),
            lambda reason: self.journal.event("fault", reason, fired_at=time.time()))
        self._saved: dict | None = self._load_saved() if self.group.reconstructed else None
        if self._saved is None:
            self._keep_secret()
        self.spares = SparePool(self.cfg.workers.spares, self.group, self.prefix, lambda slot: self._spec(slot, 0),
                                self._persist, self.journal.wait_saved, self.journal.event,
                                wanted=self._may_start,
                                settled=lambda: not (self.book.pending or self.book.slots_in(S.STARTING, S.READY)),
                                started=(self._saved or {}).get("started_spares", 0))
        self.publisher = Publisher(self.book, self.group, self.algorithm.kind, self.incarnation,
                                   lambda: self.server, self._persist,
                                   lambda version, sent: self.faults.maybe_die("publish", version, sent))
        self.admission = Admission(self.book, self.journal, self.group, self.algorithm.kind, self.cfg.workers.min,
                                   lambda: self.state, self._may_start, lambda: self.history, self.reshape,
                                   self._start_run, lambda reason, detail: self.end(JobState.FAILED, reason, detail))
        self.launcher = Launcher(self.book, self.spares, self.group, self.prefix, self._spec,
                                 self.journal.fired, self.journal.event, lambda: self.state, self._may_start,
                                 self.admission.request,
                                 started=max((self._saved or {}).get("started_workers", 0),
                                             self.incarnation * WORKER_STARTS_PER_INCARNATION))
        self.trial: Trial | None = None
        """`sync.auto`'s online trial (actors/control/trial.py), on the first incarnation only."""
        if self.cfg.policy_trial and self._saved is None and not self.cfg.policy_trial.get("resumed"):
            self.trial = Trial(self.cfg.policy_trial, self._switch_policy, self.journal.event,
                               lambda: not self.book.pending and self.stop_kind is None and self.state == JobState.RUNNING)
        self.supervisor = Supervisor(self.cfg, self.book, self.group, self, self.journal.event, self.algorithm.kind,
                                     lambda: self.journal.step)
        self._recovered = asyncio.Event()
        """Set once a restarted incarnation has re-attached its workers (at once for the first one):
        `scale` waits for it, since Ray may hand a restarted coordinator a call the dead one had taken."""
        if self._saved is None:
            self._recovered.set()
        else:
            self.group.call_self(self.name, self.cfg.ray.namespace, "start")  # nobody else will
            if self.algorithm.kind in SERVER_KINDS:  # detached: it trained on without us
                self.server = ServerControl.attach(self.cfg, self.run_id)
        self.history = self.journal.open_history(self.algorithm.reporter, self.journal.step, self.book.live)
        if self.cfg.tracking.tensorboard:
            self.journal.listeners.append(TensorBoard.for_run(self.cfg.tracking.tensorboard, self.run_dir, self.name,
                                                              run_id, self.history.reporter == "each", self.incarnation))
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
        if not self._recovered.is_set():  # restarted, not re-attached yet: the dead incarnation's workers stand
            state["members"], spares = self._saved["members"], [*self._saved.get("spares", ()), *spares]
        state.update({"incarnation": self.incarnation, "state": self.state.value, "stop_kind": self.stop_kind,
                      "cause": self.cause, "started_at": self.started_at, "running_since": self.running_since,
                      "loss": self.journal.loss, "metrics": dict(self.journal.metrics), "spares": spares,
                      "started_workers": self.launcher.started, "started_spares": self.spares.started})
        return self.journal.save_state(state)

    def _keep_secret(self) -> None:
        """The rendezvous key where a restart finds it and no mirror copies it: `secret.key` (0600) in the
        run folder and Ray's KV store (another node's restart), never the state file (mirrored to the store)."""
        if not self.secret:
            return
        self._keep_secret_file(self.secret)
        self.group.keep_secret(f"{self.name}/{self.run_id}", self.secret)

    def _recall_secret(self, saved: dict) -> bytes:
        """The key the live workers hold: the run folder's, else Ray's KV store's (a restart on another
        node), else an older run's state file's."""
        try:
            return bytes.fromhex((self.run_dir / SECRET_FILE).read_text().strip())
        except (OSError, ValueError):
            pass
        kept = self.group.recall_secret(f"{self.name}/{self.run_id}") if self.cfg.comm.sign_rendezvous else None
        if kept:
            self._keep_secret_file(kept)
            return kept
        if saved.get("secret"):  # a state file written before the key moved out of it
            return bytes.fromhex(saved["secret"])
        if self.secret:
            log.warning("restarted without the rendezvous key (no %s, nothing in Ray's KV store): the live workers "
                        "hold another one, and groups they form with new members will refuse it", SECRET_FILE)
        return self.secret

    def _keep_secret_file(self, secret: bytes) -> None:
        runfiles.write_bytes_atomic(self.run_dir / SECRET_FILE, secret.hex().encode())
        os.chmod(self.run_dir / SECRET_FILE, 0o600)

    def _load_saved(self) -> dict:
        saved = self.journal.load_state()
        self.incarnation = max(self.incarnation, saved["incarnation"] + 1)
        self.sequencer.trust_first = True  # the live workers numbered their messages to the dead incarnation
        self.secret = self._recall_secret(saved)
        self.state, self.stop_kind, self.cause = JobState(saved["state"]), saved["stop_kind"], saved["cause"]
        self.running_since, self.started_at = saved["running_since"], saved["started_at"]
        self.book.load(saved)
        return saved

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

    async def scale(self, count: int) -> dict:
        """Grow or shrink to `count` workers without restarting anyone; returns once decided."""
        await self._recovered.wait()
        w = self.cfg.workers
        if not w.min <= count <= w.max:
            raise ValueError(f"scale: {count} workers is outside [workers.min, workers.max] = [{w.min}, {w.max}]")
        if not self.state.active:
            raise ValueError(f"scale: the job is {self.state.value}; only a running or paused job can be scaled")
        self.book.target_count = count
        self._persist()
        await self._converge(f"scale to {count} requested", "scale request")
        return self._status().to_dict()

    async def _scale_by_fault(self, count: int) -> None:
        try:
            await self.scale(count)
        except ValueError as err:  # the job ended or stops meanwhile: said, not raised into the loop
            self.journal.event("info", f"faults.scale to {count} not done: {err}")

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
        self.journal.event("samples_skipped", f"{slot} skipped {len(ids)} bad sample(s) at step {step}: ids "
                           f"{ids[:10]}{'...' if len(ids) > 10 else ''} ({reason})", slot=slot, step=step, ids=ids,
                           reason=reason)

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

    # ------------------------------------------------------------------ the main task
    async def _main(self) -> None:
        try:
            try:
                await (self._recover() if self._saved is not None else self._begin())
            finally:
                self._recovered.set()
                self._persist()  # the members it re-attached (saved before as the dead incarnation left them)
            asyncio.get_running_loop().create_task(self.supervisor.heartbeats())
            while not self.state.terminal:
                batch = await self.supervisor.next_outcomes(0.2)
                if batch:
                    await self.supervisor.handle(batch)
                else:
                    self._parent.exit_if_orphaned()
                    await self._check_limits()
                    self.journal.check_mirror()
                step_times = lambda: {m.slot: round(m.compute_s, 6) for m in self.book.members.values()  # noqa: E731
                                      if m.state is S.TRAINING and m.compute_s > 0}
                ticked = self.metrics.tick(self.journal.throughput(), step_times,
                                           self.server.summary if self.server else {}, self.spares.ready(),
                                           tokens_per_s=self.journal.tokens_throughput(),
                                           mirror_lag_s=self.journal.mirror.lag_s() if self.journal.mirror else None)
                if ticked is not None:  # once a second
                    self.journal.step_times(ticked)
        except NoWorkerCanStart as err:  # the workers' own error is the cause, not the coordinator's
            if not self.state.terminal:
                await self.end(JobState.FAILED, str(err))
        except Exception as err:  # noqa: BLE001 - the job fails with the cause, never hangs
            if not self.state.terminal:
                await self.end(JobState.FAILED, f"coordinator error: {type(err).__name__}: {err}",
                               detail={"traceback": traceback.format_exc()})
        finally:
            await self._linger()

    async def _begin(self) -> None:
        if self.cfg.policy_choice:  # sync.policy: auto, resolved by the driver (orchestrator/planner.py)
            self.journal.event("info", self.cfg.policy_choice, policy=self.cfg.sync.policy)
        if self.algorithm.kind in SERVER_KINDS:  # it holds the initial state and the first membership before any pull
            self.server = await ServerControl.start(self.cfg, self.config_dict, self.run_id, str(self.run_dir))
            what = "parameter server" if self.algorithm.kind == "server" else "lease dispenser"
            self.journal.event("info", f"{what} started (pid {self.server.pid})", pid=self.server.pid)
        self.launcher.spawn([f"w{i}" for i in range(self.cfg.workers.count)], "initial membership", "start")
        members = await self.launcher.first_members(self._starting)
        if self.resume_from:
            await resume(self.resume_from, self.book.members[members[0]], self.group, self.server, self.history,
                         self.journal)
        self.publish(members, "initial membership")
        for slot in members:
            self._start_run(self.book.members[slot])
        self.running_since, self.cause = time.time(), None
        self.transition(JobState.RUNNING, f"{len(members)} workers started and received the first plan")
        self.spares.fill()  # only now: the first members do not compete with spares for resources

    async def _recover(self) -> None:
        """A restarted coordinator: re-attach to the workers that are still alive (they kept training:
        a formed group needs no coordinator), collect the records they committed meanwhile, and
        publish a membership epoch newer than any they hold, under this incarnation's group names."""
        decided = time.time()
        if self.cfg.policy_trial:
            running = self.book.policy["label"] if self.book.policy else self.cfg.policy_trial["candidates"][0]["label"]
            self.journal.event("info", f"policy trial: not resumed by the restarted coordinator; {running} runs on",
                               policy=running)
        self.faults.maybe_die("recover")
        found, lost, epochs = await reattach(self._saved, self.book, self.group, self.prefix, self.supervisor.watch)
        server_epoch = 0
        if self.server is not None:
            await self.server.refresh_summary()
            server_epoch = int((self.server.summary or {}).get("membership_epoch", 0))
        self.book.epoch = recovered_epoch(self.book.epoch, epochs, server_epoch) - 1  # the next publication takes the one after
        self.book.version = max(self.book.version, self.book.plan.version if self.book.plan else 0)
        for record in await records_since(found, self.book, self.group, self.history.written_step):
            self._accept_record(record)
        if self.server is not None:  # what it reported while no coordinator listened
            for record in await self.server.records_after(self.history.written_step):
                self._accept_record(record)
        self.journal.event("restart", f"coordinator restarted as incarnation {self.incarnation}: re-attached "
                           f"{', '.join(found) or 'no worker'}" + (f"; lost {', '.join(lost)}" if lost else ""),
                           incarnation=self.incarnation, reattached=found, lost=lost, history_step=self.journal.step)
        live = self.book.live()
        if not live:
            raise RuntimeError("restarted and found no live worker holding the committed state (resume with --resume)")
        if self.stop_kind is None:
            self.reshape(live, f"coordinator restarted (incarnation {self.incarnation})", "coordinator restart",
                         decided, new_epoch=True)
            await self._converge("replace workers lost while the coordinator was down", "replacement")
        else:
            self.publish(live, self.cause or "stopping", new_epoch=True)
        self.spares.fill()

    def _starting(self, unplaced: bool, cause: str) -> None:
        """Below workers.min after pause_after_s (the launcher's `first_members`): PAUSED while some worker
        cannot be placed, STARTING (with how many are up) while the placed ones start."""
        if unplaced:
            if cause != self.cause:
                self.cause = cause
                if self.state == JobState.STARTING:
                    self.transition(JobState.PAUSED, cause)
            return
        self.cause = cause
        if self.state == JobState.PAUSED:
            self.transition(JobState.STARTING, "every worker is placed: " + cause)

    # ------------------------------------------------------------------ plans
    def _start_run(self, member: Member) -> None:
        self.group.run(member.handle)
        member.move(S.TRAINING)
        self.supervisor.watch(member)

    async def _converge(self, reason: str, detector: str) -> None:
        """Start or retire workers until the membership matches the target count (slots permitting)."""
        async with self._reshape_lock:
            if not self.state.active or self.stop_kind is not None:
                return
            missing, joiners, leavers = self.book.converge()
            if missing and not joiners:
                self.journal.event("info", f"{reason}: no free slot (retired: {', '.join(sorted(self.book.retired)) or 'none'})")
            if joiners:
                self.launcher.spawn(joiners, reason, detector)
            elif leavers:
                for slot in leavers:
                    self.book.members[slot].move(S.LEAVING)
                self.reshape(tuple(s for s in self.book.live() if s not in leavers), reason, detector, time.time(),
                             leavers=tuple(leavers))

    def publish(self, members: tuple[str, ...], reason: str, new_epoch: bool = False) -> Plan:
        plan = self.publisher.publish(members, reason, self.history.written_step, new_epoch)
        if self.trial is not None:
            self.trial.membership(plan.nodes)  # a node joining or leaving runs the trial again
        return plan

    def reshape(self, members: tuple[str, ...], reason: str, detector: str, detected_at: float,
                joiners: tuple[str, ...] = (), leavers: tuple[str, ...] = (), new_epoch: bool = False) -> Plan:
        old = self.book.plan.members
        if self.state in (JobState.RUNNING, JobState.PAUSED):
            self.transition(JobState.RESHAPING, reason, persist=False)  # the publication below saves both
        plan = self.publish(members, reason, new_epoch=new_epoch)
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
            self.abort_epoch(reason)
            self.reshape(live, reason, "collective failure", time.time(), new_epoch=True)

    def abort_epoch(self, reason: str) -> None:
        self.publisher.abort_epoch(reason)

    def _switch_policy(self, policy: dict, reason: str) -> None:
        """The trial's switch: the live members again, as a new membership epoch whose plan carries `policy`."""
        self.book.policy = policy
        self.journal.event("policy_switch", reason, policy=policy["label"])
        self.reshape(self.book.live(), reason, "policy trial", time.time(), new_epoch=True)

    def _policy_committed(self, policy: dict) -> None:
        self.book.policy = policy  # no longer fresh: later plans (a join, a re-form) carry it as is

    # ------------------------------------------------------------------ what decisions call (Actions)
    def view(self) -> JobView:
        checkpoint = self.journal.checkpoint
        return self.book.view(self.state, self.stop_kind, checkpoint[0] if checkpoint and
                              self.algorithm.kind not in SERVER_KINDS else None)

    def set_cause(self, cause: str | None) -> None:
        self.cause = cause

    def begin_stop(self, kind: str, cause: str, stop_step: int) -> None:
        self.stop_kind, self.cause, self.book.stop_step = kind, cause, stop_step
        if self.server is not None:
            self.server.close(cause)  # members stop at their next pull
        asyncio.get_running_loop().create_task(self._force_stop_after(self.cfg.comm.timeout_s + FORCE_STOP_AFTER_S))
        self.faults.die_on_report = True

    def restore_on_admit(self) -> None:
        self.admission.restore = self.journal.checkpoint

    def replace(self, slot: str) -> None:
        asyncio.get_running_loop().create_task(self._converge(f"replace {slot}", "replacement"))

    async def slot_failed(self, member: Member, phase: str, cause: str) -> bool:
        return await self.launcher.slot_failed(member, phase, cause)

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

    # ------------------------------------------------------------------ history and limits
    def _accept_record(self, record: dict) -> None:
        newest = self.journal.offer(record)
        if not newest and not record.get("final"):
            return  # a step already in history, a stale report of a redone one, or one ahead of a gap
        if newest and self.faults.scales:
            for count in self.faults.due_scales(self.journal.step):
                asyncio.get_running_loop().create_task(self._scale_by_fault(count))
        if newest and self.book.pending:
            for detail in self.book.close_reshapes(record):
                self.journal.event("reshape", f"{detail['cause']}: {detail['old_members']} -> {detail['new_members']} "
                                   f"({detail['detector']}, {detail['duration_s']:.2f}s)", **detail)
            if not self.book.pending and self.state == JobState.RESHAPING:
                self.cause = None  # a pause, if there was one, is over
                self.transition(JobState.RUNNING, f"membership epoch {record.get('membership_epoch', 0)} "
                                                  f"committed step {record['step']}")
            if self.book.slots_in(S.READY):  # joiners held back for the survivors' first step
                asyncio.get_running_loop().create_task(self.admission.request())
        if newest and self.trial is not None:
            self.trial.offer(record, self._policy_committed)
        target, metrics = self.cfg.stop.target, self.journal.metrics
        if target is None or self.stop_kind is not None or target.metric not in metrics:
            return
        value = metrics[target.metric]
        if (value >= target.value) if target.mode == "max" else (value <= target.value):
            asyncio.get_running_loop().create_task(self.supervisor.stop(
                "FINISHED", f"target reached: {target.metric} = {value:.4f} ({target.mode} {target.value})"))

    async def _check_limits(self) -> None:
        if not self.state.active or self.stop_kind is not None:
            return
        if self.owner_job and time.monotonic() - self._owner_checked >= OWNER_CHECK_S:
            self._owner_checked = time.monotonic()
            if await asyncio.to_thread(self.group.job_is_dead, self.owner_job):
                await self.supervisor.stop("STOPPED", "the process that owned this job (python -m orchestrator run) is gone")
                return
        stop = self.cfg.stop
        if self.state != JobState.PAUSED and stop.time_s is not None and self.running_since \
                and time.time() - self.running_since >= stop.time_s:
            await self.supervisor.stop("FINISHED", f"time limit of {stop.time_s:g}s reached")

    async def _force_stop_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self.state.terminal:
            self.history.close()
            # Members stuck in a step: those on this node are SIGKILLed, gone before the job reports its
            # end, not once Ray's kill reaches them (a run of the suite here saw two alive 0.5 s after stop()).
            for member in self.book.members.values():
                if member.state.live:
                    self.group.kill_process(member.node, member.pid)
            await self.end(JobState(self.stop_kind or "STOPPED"),
                           f"members did not stop within {delay:.0f}s; their actors were killed", quiet=True)

    # ------------------------------------------------------------------ endings
    async def finish(self) -> None:
        """Every member of the plan finished at the same committed step: keep the model, end the job."""
        kind = JobState(self.stop_kind or "FINISHED")
        survivors = await wrap_up(kind, self.algorithm, self.book, self.group, self.server, self.history,
                                  self.journal, self._accept_record)
        if kind == JobState.FINISHED:
            self.cause = None
        await self.end(kind, self.cause or f"all members reached the stop step {self.journal.step}", quiet=True,
                       survivors=survivors)

    async def end(self, state: JobState, reason: str, detail: dict | None = None, quiet: bool = False,
                  survivors: dict | None = None) -> None:
        """Tear every actor of the job down and enter a terminal state (FAILED records the failure)."""
        if state == JobState.FAILED and not quiet:
            self.cause = reason
            self.journal.event("failure", reason, **(detail or {}))
        self.history.close()
        if self.server is not None:
            self.server.kill()
        self.spares.kill_all()
        self.group.release_data(self.name, self.run_id)
        for member in self.book.members.values():
            self.group.kill(member.handle)
            if not member.state.departed:
                member.move(S.FINISHED if member.state == S.FINISHED else S.STOPPED)
        self.transition(state, reason, **({"survivors": survivors} if survivors else {}))
        self.journal.write_status(self._status().to_dict())

    async def _linger(self) -> None:
        # the run report (actors/report.py), before the driver's release lets this process go
        await asyncio.to_thread(draw_at_end, self.run_dir, self.cfg.tracking.report, self.journal.event)
        if (self.run_dir / "report.png").exists():
            self.journal.put("report.png")
        if self.owner_job and await asyncio.to_thread(self.group.job_is_dead, self.owner_job):
            self._released.set()  # its owner is gone: nobody will read the result from this actor
        try:
            await asyncio.wait_for(self._released.wait(), LINGER_S)
        except asyncio.TimeoutError:
            pass
        self.journal.close()
        self.group.exit()

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
                         reshapes=self.journal.recent_reshapes(), departed=tuple(self.book.departed),
                         incarnation=self.incarnation, coordinator_pid=os.getpid(),
                         started_at=self.started_at, ended_at=self.ended_at,
                         stragglers={slot: round(r, 3) for slot, r in self.supervisor.stragglers.current.items()},
                         server=dict(self.server.summary, restarts=self.server.restarts) if self.server else {},
                         topology=topology_status(getattr(self.cfg.sync, "topology", None), plan), spares=self.spares.status(),
                         checkpoint=self.journal.checkpoint_status())


CoordinatorActor = ray.remote(num_cpus=0)(Coordinator)
