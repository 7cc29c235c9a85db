"""The coordinator: membership, plans, the job's state machine, reports and the run directory.

One per job run, named `<job name>` in the namespace `orchestrator` so that any process can
attach. It hosts the TCPStore that groups rendezvous on (bound to the node's address), starts
the detached worker actors, publishes plans, and supervises: it `await`s each worker's
`watch()` (which returns when `run()` ends, and raises when the process dies), so a death is
seen within tens of milliseconds and the membership epoch is aborted on every other member.
It is not on the per-step data path: workers report progress in batches.

It decides nothing on its own about failures and stops: it hands a frozen view of the job and
the event to `algorithms/supervision.py` and carries out the decision. States (an enum there):
STARTING -> RUNNING -> (RESHAPING -> RUNNING)* -> STOPPING -> STOPPED / FINISHED / FAILED, with
PAUSED below `workers.min`. Every transition is an `Event` with its reason, appended to
`events.jsonl`; history records go to `history.jsonl` (actors/history.py).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import os
import secrets
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import ray
from ray.exceptions import ActorDiedError, RayActorError

from actors import checkpoints, runfiles
from actors.faults import CoordinatorFaults
from actors.history import History
from actors.members import Member, Spare, ask, describe, probe, first_line, is_placed, job_is_dead, kill, log, log_to
from actors.plan import ParentWatch, Plan, Progress, WorkerSpec
from actors.sequencer import Order, Sequencer
from actors.server_control import ServerControl, restart_event
from actors.store import EpochKeys, serve_store
from actors.worker import WorkerActor
from algorithms.kinds import SERVER_KINDS, PolicyTraits
from algorithms.membership import MemberView, batch_for, choose_leavers, free_slots, joiners_start_stateless, server_members, slot_index
from algorithms.stragglers import StragglerWatch
from algorithms.topologies import get_topology, spectral_gap
from algorithms.zipline import BarrierPlanner
from algorithms.supervision import (
    Decision, JobState, JobView, MemberEnded, MemberState, StopRequested, decide, recovered_epoch,
)
from core.schema import ElasticBSPConfig, Event, JobConfig, JobStatus, MemberStatus, parse

PROBE_S = 1.0
"""How long a member may take to answer a probe after a collective failed."""
OWNER_CHECK_S = 1.0
LINGER_S = 600.0
"""A finished coordinator stays this long for `status`, unless released earlier."""
MAX_RESTARTS = 5
"""How often Ray restarts a coordinator whose process dies; each restart carries on from the run
directory and the live workers (a new incarnation)."""
ADMIT_HOLD_S = 1.0
"""At most this long, joiners wait for the survivors of a departure to commit a step without it."""
SPARE_SETTLE_S = 10.0
"""A spare that replaces one taken starts once no reshape is pending, or after this long at most."""
SAVED = "coordinator.json"
S = MemberState
STRAGGLER_WARMUP_STEPS = 20
"""Steps a member trains before its step-time estimate is compared with the others'."""
EVENTS_KEPT = 1000
"""Events kept in memory (events.jsonl keeps every one)."""
RESHAPES_SHOWN = 20
"""The newest reshapes in status (as with departed members)."""


class Coordinator:
    def __init__(self, config: dict, run_id: str, run_dir: str, incarnation: int = 0, search_path: tuple[str, ...] = (),
                 resume_from: Optional[str] = None, owner_job: Optional[str] = None,
                 started_at: Optional[float] = None) -> None:
        self.search_path = tuple(search_path)
        self._parent = ParentWatch()
        self.resume_from = resume_from
        self.cfg: JobConfig = parse(JobConfig, config)
        self.config_dict = config
        self.name, self.run_id, self.run_dir, self.incarnation = self.cfg.name, run_id, Path(run_dir), incarnation
        self.node_ip = ray.util.get_node_ip_address()
        self.sequencer = Sequencer()
        """Runs each worker's messages in the order it sent them (Ray does not, for an asyncio actor)."""
        self.secret = secrets.token_bytes(32) if self.cfg.comm.sign_rendezvous else b""
        """The job's rendezvous key: its workers sign what they write to the group store (actors/comm.py);
        a restarted coordinator keeps the one on disk (its live workers have it)."""
        self._store_up = _in_thread(serve_store, self.node_ip, self.cfg.comm.timeout_s)
        """The job's group store, served once torch.distributed has loaded in that thread: the first
        workers start meanwhile (this module imports no torch; `_serve_store` waits for it)."""
        self.store: Any = None
        self.store_port = 0
        self.epoch_keys: Optional[EpochKeys] = None
        self.state = JobState.STARTING
        self.cause: Optional[str] = None
        self.members: dict[str, Member] = {}
        self.plan: Optional[Plan] = None
        self.epoch = self.version = self.step = 0
        self.loss: Optional[float] = None
        self.metrics: dict = {}
        self.recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, step) of the last 5 s
        self.events: collections.deque[Event] = collections.deque(maxlen=EVENTS_KEPT)
        """The newest events (events.jsonl holds them all)."""
        self.fired_faults: set[int] = set(runfiles.read_json(self.run_dir / "faults_fired.json", []))
        self.faults = CoordinatorFaults(
            self.cfg.faults, set(runfiles.read_json(self.run_dir / "coordinator_faults_fired.json", [])),
            lambda fired: runfiles.write_json_atomic(self.run_dir / "coordinator_faults_fired.json", sorted(fired)),
            lambda reason: self._event("fault", reason, fired_at=time.time()))
        self.started_at = started_at or time.time()
        """When `start()` was called (the job's run time counts from there)."""
        self.ended_at: Optional[float] = None
        self.running_since: Optional[float] = None
        self.stop_kind: Optional[str] = None
        self.stop_step: Optional[int] = None
        """Once a stop is decided, every plan published carries it (a reshape must not lose it)."""
        self._gap: Optional[tuple[int, float]] = None
        """A gossip policy's (world size, spectral gap) last computed for status."""
        self.target_count = self.cfg.workers.count
        self.started_workers = 0
        """Worker starts so far: each start of a slot is a new worker incarnation (the server fences the old)."""
        self.spares: list[Spare] = []
        """Hot spares (`workers.spares`), oldest first."""
        self.started_spares = 0
        self._settling: Optional[asyncio.Task] = None
        self.server: Optional[ServerControl] = None
        self.failures: dict[str, int] = {}
        self._state_file_error = ""
        """The state file's last write failure that an event already reported."""
        self._checkpoint: Optional[tuple[int, str]] = None
        """(step, path) of this run's newest checkpoint (what a loss of every member restarts from)."""
        self._restore: Optional[tuple[int, str]] = None
        """Set when every member was lost: the next admitted worker starts from this checkpoint."""
        self.retired: dict[str, str] = {}
        self.departed: list[MemberStatus] = []
        self.pending: list[dict] = []
        """Reshapes decided but not yet followed by a committed step in their membership epoch."""
        self._last_reform = 0.0
        self._probing = False
        self.owner_job: Optional[str] = owner_job
        self._owner_checked = 0.0
        self._reshape_lock: Optional[asyncio.Lock] = None
        self.outcomes: asyncio.Queue = None  # type: ignore[assignment]  # made on the event loop
        self._main_task: Optional[asyncio.Task] = None
        self._released: Optional[asyncio.Event] = None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log_to(self.run_dir / "coordinator.log", self.cfg.log_level)
        self._events = open(self.run_dir / "events.jsonl", "a", encoding="utf-8")
        self.stragglers = StragglerWatch()
        self._saved: Optional[dict] = None
        self._saver = runfiles.BackgroundWriter(self.run_dir / SAVED)
        written = 0
        if ray.get_runtime_context().was_current_actor_reconstructed:
            written = self._load_saved()
            call_self_when_alive(self.name, self.cfg.ray.namespace, "start")  # nobody else will
        self._recovered = asyncio.Event()
        """Set once a restarted incarnation has re-attached its workers (at once for the first one):
        `scale` waits for it, since Ray may hand a restarted coordinator a call the dead one had taken."""
        if self._saved is None:
            self._recovered.set()
        self.algorithm = PolicyTraits(self.cfg.sync.policy)
        """What the coordinator needs of the policy: its kind's answers (algorithms/kinds.py)."""
        self.barriers = BarrierPlanner(self.cfg.sync.r, self.cfg.sync.ewma) if isinstance(self.cfg.sync, ElasticBSPConfig) else None
        """elastic_bsp: ZipLine over each member's predicted iteration interval."""
        if self._saved is not None and self.algorithm.kind in SERVER_KINDS:  # detached: it trained on without us
            self.server = ServerControl.attach(self.cfg, self.run_id)
        self.history = History(self.run_dir / "history.jsonl", self.algorithm.reporter, written,
                               note=lambda reason, detail: self._event("info", reason, **detail))
        if self._saved is not None and self.state == JobState.RUNNING:  # status() never says RUNNING before re-attaching
            self._transition(JobState.RESHAPING, f"coordinator restarted as incarnation {self.incarnation}: re-attaching workers")
        else:
            self._persist()

    # ------------------------------------------------------------------ persistence (restarts)
    def _persist(self) -> int:
        """What a restarted coordinator cannot re-learn from the live workers, handed to the state file's
        writer thread (fsync never blocks the event loop); returns the snapshot's number."""
        members = {slot: {"state": m.state.value, "pid": m.pid, "node": m.node, "node_id": m.node_id, "cause": m.cause,
                          "incarnation": m.incarnation, "actor_name": m.actor_name, "holds_state": m.holds_state}
                   for slot, m in self.members.items()}
        spares = [s.name for s in self.spares]
        if not self._recovered.is_set():  # restarted, not re-attached yet: the dead incarnation's workers stand
            members, spares = self._saved["members"], [*self._saved.get("spares", ()), *spares]
        error = self._saver.error
        if error is not None and str(error) != self._state_file_error:
            self._state_file_error = str(error)  # said once a failure, not at every persist
            self._event("info", f"the state file could not be written ({error}): a coordinator restart now would "
                                f"carry on from an older state; the newest state is written again at the next "
                                f"change", error=str(error))
        elif error is None:
            self._state_file_error = ""
        return self._saver.submit(runfiles.json_bytes({
            "incarnation": self.incarnation, "epoch": self.epoch, "version": self.version, "state": self.state.value,
            "plan": dataclasses.asdict(self.plan) if self.plan else None, "target_count": self.target_count,
            "failures": self.failures, "retired": self.retired, "stop_kind": self.stop_kind, "cause": self.cause,
            "stop_step": self.stop_step, "started_at": self.started_at, "running_since": self.running_since,
            "members": members, "pending": self.pending, "departed": [d.__dict__ for d in self.departed],
            "loss": self.loss, "metrics": self.metrics, "started_workers": self.started_workers,
            "spares": spares, "started_spares": self.started_spares,
            "secret": self.secret.hex()}))

    def _load_saved(self) -> int:
        """Carry on from the run directory; returns the newest step in history."""
        saved = runfiles.read_json(self.run_dir / SAVED)
        if saved is None:
            raise RuntimeError(f"restarted, but {self.run_dir / SAVED} is missing: cannot carry on")
        self._saved = saved
        self.incarnation = saved["incarnation"] + 1
        self.sequencer.trust_first = True  # the live workers numbered their messages to the dead incarnation
        self.secret = bytes.fromhex(saved["secret"]) if saved.get("secret") else self.secret
        self.epoch, self.version, self.state = saved["epoch"], saved["version"], JobState(saved["state"])
        self.target_count, self.failures, self.retired = saved["target_count"], saved["failures"], saved["retired"]
        self.stop_kind, self.cause, self.running_since = saved["stop_kind"], saved["cause"], saved["running_since"]
        self.stop_step, self.started_at = saved["stop_step"], saved["started_at"]
        self.pending, self.loss, self.metrics = saved["pending"], saved["loss"], saved["metrics"]
        self.started_workers = saved.get("started_workers", 0)
        self.started_spares = saved.get("started_spares", 0)
        self.departed = [MemberStatus(**d) for d in saved["departed"]]
        if saved["plan"]:
            self.plan = Plan(**{k: tuple(v) if k in ("members", "nodes") else v for k, v in saved["plan"].items()})
        self.events = collections.deque((Event(**e) for e in runfiles.read_jsonl(self.run_dir / "events.jsonl")),
                                        maxlen=EVENTS_KEPT)
        history = runfiles.read_jsonl(self.run_dir / "history.jsonl")
        self.step = history[-1]["step"] if history else 0
        return self.step

    # ------------------------------------------------------------------ public methods
    async def start(self) -> dict:
        if self._main_task is None:
            self.outcomes = asyncio.Queue()
            self._released = asyncio.Event()
            self._reshape_lock = asyncio.Lock()
            self._main_task = asyncio.get_running_loop().create_task(self._main())
        return {"node": self.node_ip, "pid": os.getpid()}

    async def status(self) -> dict:
        return self._status().to_dict()

    async def list_events(self) -> list[dict]:
        return [e.to_dict() for e in self.events]

    async def report(self, progress: Progress, order: Optional[Order] = None) -> None:
        await self.sequencer.turn(order)
        if self.faults.die_on_report and progress.records:
            self.faults.maybe_die("stop")
        member = self.members.get(progress.slot)
        if member is not None:
            member.step, member.last_report, member.compute_s = progress.mark, time.time(), progress.compute_s
            self._watch_stragglers()
        with self.history.batch():
            for record in progress.records:
                try:
                    self._accept_record(record)
                except Exception as err:  # noqa: BLE001 - one bad record must not drop the rest
                    self._event("info", f"could not record step {record.get('step')}: {type(err).__name__}: {err}")

    def _watch_stragglers(self) -> None:
        """Name the training members whose step time is well above the median (events on each change).
        A member's first steps (imports, allocation, a cold cache) say nothing about its speed."""
        live = {slot: m.compute_s for slot, m in self.members.items()
                if m.state is MemberState.TRAINING and m.step >= STRAGGLER_WARMUP_STEPS}
        for change in self.stragglers.update(live):
            verb = "is a straggler" if change.straggler else "is no longer a straggler"
            ratio = f": {change.ratio:.2f}x the median step time" if change.ratio else ""
            self._event("straggler", f"{change.slot} {verb}{ratio}", slot=change.slot,
                        straggler=change.straggler, ratio=round(change.ratio, 3))

    async def fault_fired(self, index: int, slot: str, step: int, phase: str, order: Optional[Order] = None) -> None:
        await self.sequencer.turn(order)
        self.fired_faults.add(index)
        runfiles.write_json_atomic(self.run_dir / "faults_fired.json", sorted(self.fired_faults))
        self._event("fault", f"injected fault #{index} fires in {slot} at step {step} during {phase}",
                    slot=slot, step=step, phase=phase, fired_at=time.time())

    async def request_stop(self, reason: str = "stop requested") -> dict:
        """Graceful stop: every member stops at the same committed step; state STOPPED."""
        await self._stop("STOPPED", reason)
        return self._status().to_dict()

    async def scale(self, count: int) -> dict:
        """Grow or shrink to `count` workers without restarting anyone; returns once decided."""
        await self._recovered.wait()
        w = self.cfg.workers
        if not w.min <= count <= w.max:
            raise ValueError(f"scale: {count} workers is outside [workers.min, workers.max] = [{w.min}, {w.max}]")
        if not self.state.active:
            raise ValueError(f"scale: the job is {self.state.value}; only a running or paused job can be scaled")
        self.target_count = count
        self._persist()
        await self._converge(f"scale to {count} requested", "scale request")
        return self._status().to_dict()

    async def state_received(self, slot: str, epoch: int, source: str, step: int,
                             order: Optional[Order] = None) -> None:
        """A member that was behind loaded the state broadcast by `source` at epoch start. When the
        epoch's reshape event already went out (the kinds whose other members train on), an event of
        its own says so."""
        await self.sequencer.turn(order)
        if slot in self.members:
            self.members[slot].holds_state = True
        pending = [r for r in self.pending if r["membership_epoch"] == epoch]
        for reshape in pending:
            reshape["state_sources"][slot] = {"source": source, "step": step}
        if not pending:
            self._event("info", f"{slot} received the state of {source} at step {step} (membership epoch {epoch})",
                        slot=slot, state_source={"source": source, "step": step}, membership_epoch=epoch)

    async def epoch_agreed(self, epoch: int, step: int, records: tuple[dict, ...], order: Optional[Order] = None) -> None:
        """Rank 0 of `epoch`: its members agreed that `step` is the newest committed step; `records`
        are those it keeps after the plan's history step (what a departed rank 0 never reported)."""
        await self.sequencer.turn(order)
        for record in records:
            self._accept_record(record)
        if step < self.history.written_step and epoch == self.epoch and not self.state.terminal:
            # Below a step history holds as final: none of the epoch's members holds the committed
            # state (joiners alone would start over). Never train on from there: end, resumable.
            await self._end(JobState.FAILED, f"the members of membership epoch {epoch} agreed on step {step}, below the "
                                             f"committed step {self.history.written_step}: none of them holds the "
                                             f"committed state (resume with --resume)")
            return
        self.history.agreed(epoch, step)
        self.step = self.history.step()

    async def server_report(self, records: tuple[dict, ...], summary: dict) -> None:
        """The parameter server applied these versions (history records) and now counts `summary`."""
        if self.server is not None:
            self.server.summary = summary
            if records and records[0]["step"] > self.history.written_step + 1:  # reports lost in a restart
                records = await self.server.records_after(self.history.written_step)
        for record in records:
            self._accept_record(record)

    async def server_barrier(self, index: int, members: tuple[str, ...], intervals: dict[str, list[float]]) -> None:
        """elastic_bsp: round `index` began at the server; ZipLine places its barrier from the iteration
        times measured over the last round. Without an answer (this coordinator down or slow) the server
        keeps its fallback, a barrier after `r` iterations."""
        if self.server is None or self.barriers is None:
            return
        iterations = self.barriers.plan(members, intervals)
        if iterations is not None:
            self.server.set_schedule(index, iterations)

    async def server_restarted(self, resumed: int, incarnation: int, snapshot: Optional[str]) -> None:
        """Ray restarted the parameter server from its snapshot at version `resumed`: the versions history
        holds after it are lost and redone (history records them again, with the new incarnation)."""
        if self.algorithm.kind == "background":  # no versions: its lease table started over
            self._event("server", f"lease dispenser restarted as incarnation {incarnation}: its lease table starts "
                                  f"over (samples of the current data epoch may be dealt again)", server_incarnation=incarnation)
        else:
            reason, detail = restart_event(self.history.written_step, resumed, incarnation, snapshot,
                                           self.cfg.server.snapshot_every)
            self.history.rewind(resumed)
            self.step = resumed
            self._event("server", reason, **detail)
        if self.server is not None and self.plan is not None:  # its snapshot may predate the membership
            self.server.restarts += 1
            self._tell_server(self.plan.members)

    def _tell_server(self, members) -> None:
        """The server admits this membership, as (slot, worker incarnation) in rank order."""
        plan = tuple((s, self.members[s].incarnation) for s in members)
        leaving = tuple((s, m.incarnation) for s, m in self.members.items() if m.state == S.LEAVING and s not in members)
        self.server.set_members(self.epoch, list(server_members(self.algorithm.kind, plan, leaving)))

    async def release(self) -> None:
        """Let a terminal coordinator exit now (the driver has read the result)."""
        if self._released is not None:
            self._released.set()

    async def save_checkpoint(self, step: int, blob: bytes, order: Optional[Order] = None) -> None:
        await self.sequencer.turn(order)
        self._parent.exit_if_orphaned()
        path = await asyncio.to_thread(checkpoints.save, self.run_dir, step, blob, self.cfg.checkpoint.keep)
        self._event("checkpoint", f"checkpoint at step {step}", step=step, path=str(path), bytes=len(blob))
        if self._checkpoint is None or step >= self._checkpoint[0]:
            self._checkpoint = (step, str(path))

    async def collective_failed(self, slot: str, epoch: int, error: str, order: Optional[Order] = None) -> None:
        """A member's collective failed: probe that epoch's members and evict any that do not answer;
        if every one answers, the group itself is broken: re-form it at once as a new epoch."""
        await self.sequencer.turn(order)
        if epoch != self.epoch or self.state not in (JobState.RUNNING, JobState.RESHAPING) or self._probing:
            return
        self._probing = True
        try:
            members = [self.members[s] for s in self._live_members()]
            answers = await asyncio.gather(*(probe(m.handle, "heartbeat", timeout=PROBE_S) for m in members))
            for member, (answer, died) in zip(members, answers):
                if died is not None:  # the probe learnt of a death before the member's watch() did
                    await self._evict(member, "actor death", f"worker {member.slot} died (found when {slot}'s "
                                                             f"collective failed): {died[:160]}")
                elif answer is None:
                    await self._evict(member, "collective failure",
                                      f"worker {member.slot} did not answer after {slot}'s collective failed: {error[:160]}")
            if all(a is not None for a, _ in answers) and epoch == self.epoch:
                self._reform(f"{slot}'s collective failed with every member alive: {error[:160]}")
        finally:
            self._probing = False

    # ------------------------------------------------------------------ main task
    async def _main(self) -> None:
        try:
            try:
                await (self._recover() if self._saved is not None else self._begin())
            finally:
                self._recovered.set()
                self._persist()  # the members it re-attached (saved before as the dead incarnation left them)
            asyncio.get_running_loop().create_task(self._heartbeats())
            await self._supervise()
        except Exception as err:  # noqa: BLE001 - the job fails with the cause, never hangs
            if not self.state.terminal:
                await self._end(JobState.FAILED, f"coordinator error: {type(err).__name__}: {err}",
                                detail={"traceback": traceback.format_exc()})
        finally:
            await self._linger()

    async def _serve_store(self) -> None:
        """Wait for the job's group store (needed from the first plan on)."""
        if self.store is None:
            await asyncio.wrap_future(self._store_up)
            self._take_store()

    def _take_store(self) -> None:
        if self.store is None:  # `_publish` before `_serve_store` (not expected) waits here, off no await
            self.store, self.store_port, self._store_socket = self._store_up.result()
            self.epoch_keys = EpochKeys(self.store)

    async def _begin(self) -> None:
        if self.cfg.policy_choice:  # sync.policy: auto, resolved by the driver (orchestrator/planner.py)
            self._event("info", self.cfg.policy_choice, policy=self.cfg.sync.policy)
        if self.algorithm.kind in SERVER_KINDS:  # it holds the initial state and the first membership before any pull
            self.server = await ServerControl.start(self.cfg, self.config_dict, self.run_id, str(self.run_dir))
            what = "parameter server" if self.algorithm.kind == "server" else "lease dispenser"
            self._event("info", f"{what} started (pid {self.server.pid})", pid=self.server.pid)
        self._spawn([f"w{i}" for i in range(self.cfg.workers.count)], "initial membership", "start")
        members = await self._first_members()
        await self._serve_store()
        if self.resume_from:
            await self._resume(members[0])
        self._publish(members, "initial membership")
        for slot in members:
            self._start_run(self.members[slot])
        self.running_since = time.time()
        self.cause = None
        self._transition(JobState.RUNNING, f"{len(members)} workers started and received the first plan")
        self._fill_spares()  # only now: the first members do not compete with spares for resources

    async def _recover(self) -> None:
        """A restarted coordinator: re-attach to the workers that are still alive (they kept training:
        a formed group needs no coordinator), collect the records they committed meanwhile, and
        publish a membership epoch newer than any they hold, on this incarnation's store."""
        decided = time.time()
        self.faults.maybe_die("recover")
        await self._serve_store()
        found, lost, epochs = [], [], []
        for name in self._saved.get("spares", ()):  # the dead incarnation's spares: new ones start below
            kill(self._actor_named(name))
        for slot, saved in self._saved["members"].items():
            handle = self._worker_handle(slot, saved.get("actor_name", ""))
            if saved["state"] not in (S.TRAINING.value, S.LEAVING.value):  # a joiner not admitted yet: started again
                kill(handle)
                continue
            info = await ask(handle, "status") if handle is not None else None
            member = Member(slot, handle, pid=saved["pid"], node=saved["node"], node_id=saved["node_id"], state=S(saved["state"]),
                            incarnation=saved.get("incarnation", 0), actor_name=saved.get("actor_name", ""),
                            # a joiner waiting for the state, unless it loaded one meanwhile
                            holds_state=saved.get("holds_state", True) or bool(info and info.get("holds_state")))
            self.members[slot] = member
            if info is None:
                member.state, member.cause = S.DEAD, "gone while the coordinator was down"
                self._depart(member)
                lost.append(slot)
                continue
            found.append(slot)
            newest = info["plan"]
            if newest is not None:
                epochs.append(newest.membership_epoch)
                if self.plan is None or newest.version > self.plan.version:
                    self.plan = newest  # published just before the crash, never saved
            self._start_watch(member)
        server_epoch = 0
        if self.server is not None:
            await self.server.refresh_summary()
            server_epoch = int((self.server.summary or {}).get("membership_epoch", 0))
        self.epoch = recovered_epoch(self.epoch, epochs, server_epoch) - 1  # the next publication takes the one after
        self.version = max(self.version, self.plan.version if self.plan else 0)
        await self._collect_records(found)
        if self.server is not None:  # what it reported while no coordinator listened
            for record in await self.server.records_after(self.history.written_step):
                self._accept_record(record)
        self._event("restart", f"coordinator restarted as incarnation {self.incarnation}: re-attached "
                    f"{', '.join(found) or 'no worker'}" + (f"; lost {', '.join(lost)}" if lost else ""),
                    incarnation=self.incarnation, reattached=found, lost=lost, history_step=self.step)
        live = self._live_members()
        if not live:
            raise RuntimeError("restarted and found no live worker holding the committed state (resume with --resume)")
        if self.stop_kind is None:
            self._reshape(live, f"coordinator restarted (incarnation {self.incarnation})", "coordinator restart",
                          decided, new_epoch=True)
            await self._converge("replace workers lost while the coordinator was down", "replacement")
        else:
            self._publish(live, self.cause or "stopping", new_epoch=True)
        self._fill_spares()

    async def _collect_records(self, slots: list[str]) -> None:
        """Records the members committed while this coordinator was down (some were reported to the
        dead incarnation and died with it): every member keeps its newest ones."""
        kept: dict[tuple, dict] = {}
        for slot in slots:
            for record in await ask(self.members[slot].handle, "records_after", self.history.written_step) or ():
                kept.setdefault((record["step"], record.get("slot", "")), record)
        for key in sorted(kept):
            self._accept_record(kept[key])

    def _worker_handle(self, slot: str, actor_name: str = ""):
        """The slot's live actor: by its own name, or by the name of the spare it adopted."""
        return self._actor_named(actor_name or f"{self.name}/{self.run_id}/{slot}")

    def _actor_named(self, name: str):
        try:
            return ray.get_actor(name, namespace=self.cfg.ray.namespace)
        except ValueError:
            return None

    async def _first_members(self) -> tuple[str, ...]:
        """All `count` workers ready, or at least `min` after `start_grace_s`; PAUSED while fewer than `min` fit."""
        w = self.cfg.workers
        started = time.monotonic()
        while True:
            ready = sorted(self._slots_in(S.READY), key=slot_index)
            waited = time.monotonic() - started
            if len(ready) >= w.count or (len(ready) >= w.min and waited >= w.start_grace_s):
                return tuple(ready)
            if not self._slots_in(S.STARTING, S.READY) and not free_slots(w.max, set(), set(self.retired), 1):
                raise RuntimeError(f"no slot left to start: {'; '.join(self.retired.values())}")
            if len(ready) < w.min and waited >= w.pause_after_s:
                await self._explain_start(len(ready))
            await asyncio.sleep(0.1)

    async def _explain_start(self, up: int) -> None:
        """Below workers.min after pause_after_s: PAUSED if some worker cannot be placed (no process yet
        and the cluster lacks the resources it asks for: named), else STARTING with how many are placed
        and up (imports, data). A worker with no process yet while its resources are free is being
        placed (Ray's worker start can take seconds on a loaded machine), not stuck."""
        w = self.cfg.workers
        starting = [self.members[s] for s in self._slots_in(S.STARTING)]
        placed = await asyncio.to_thread(lambda: [is_placed(m.handle) for m in starting])
        unplaced = sum(1 for p in placed if p is False)
        free = await asyncio.to_thread(ray.available_resources) if unplaced else {}
        if unplaced and (free.get("CPU", 0) < w.cpus or (w.gpus and free.get("GPU", 0) < w.gpus)):
            cause = (f"waiting for resources: {up} of workers.min = {w.min} workers up; {unplaced} cannot be placed: "
                     f"each needs {w.cpus:g} CPUs" + (f" and {w.gpus:g} GPUs" if w.gpus else "")
                     + f", the cluster has {free.get('CPU', 0):g} CPUs" + (f" and {free.get('GPU', 0):g} GPUs" if w.gpus else "")
                     + " free")
            if cause != self.cause:
                self.cause = cause
                if self.state == JobState.STARTING:
                    self._transition(JobState.PAUSED, cause)
            return
        self.cause = (f"{len(starting) + len(self._slots_in(S.READY))} of {w.count} workers placed, {up} up: "
                      f"waiting for the others to start (imports, workload)")
        if self.state == JobState.PAUSED:
            self._transition(JobState.STARTING, "every worker is placed: " + self.cause)

    def _slots_in(self, *states: MemberState) -> list[str]:
        return [slot for slot, m in self.members.items() if m.state in states]

    async def _resume(self, slot: str) -> None:
        path = Path(self.resume_from)
        problem = await asyncio.to_thread(checkpoints.verify, path.with_suffix(".json"))
        if problem:
            raise RuntimeError(f"cannot resume from {path}: {problem}")
        data = await asyncio.to_thread(path.read_bytes)
        if self.server is not None:  # a server kind: the state is the server's
            step = await self.server.load_checkpoint(data)
        else:
            step = await asyncio.wrap_future(self.members[slot].handle.load_checkpoint.remote(data).future())
        self.step = step
        self.history.ledger.written_step = step
        self._event("info", f"resumed from checkpoint at step {step} ({path})", checkpoint=str(path), step=step)

    # ------------------------------------------------------------------ workers
    def _spawn(self, slots: list[str], reason: str, detector: str) -> None:
        """Start worker actors; each is admitted by a plan once ready (imports done, data built)."""
        decided = time.time()
        for slot in slots:
            member = Member(slot, None, join_reason=(reason, detector, decided))
            self.members[slot] = member
            asyncio.get_running_loop().create_task(self._bring_up(member))

    async def _bring_up(self, member: Member) -> None:
        try:
            await self._start_worker(member)
        except Exception as err:  # noqa: BLE001 - a task's error would otherwise reach only Ray's logs
            log.exception("starting %s failed", member.slot)
            if self.members.get(member.slot) is member and member.state == S.STARTING:
                await self._slot_failed(member, "start", f"worker {member.slot} could not be started: {describe(err)}")

    def _still_starting(self, member: Member) -> bool:
        return not self.state.terminal and self.stop_kind is None and self.members.get(member.slot) is member \
            and member.state == S.STARTING

    async def _start_worker(self, member: Member) -> None:
        if not self._still_starting(member):
            return
        self.started_workers += 1
        member.incarnation = self.started_workers
        spec = WorkerSpec(self.name, self.run_id, member.slot, str(self.run_dir), self.name, self.cfg.ray.namespace,
                          self.config_dict, self.search_path, incarnation=member.incarnation, secret=self.secret)
        fired = tuple(sorted(self.fired_faults))
        info = await self._adopt_spare(member, spec, fired)
        if info is None:
            # A fresh actor's start (a process, imports: about a second of CPU) would take the cores of a
            # small node from the survivors of a departure: it waits for their first step without the
            # departed member (at most ADMIT_HOLD_S; it is admitted only after that step anyway).
            while self._held_departure(self._live_members()):
                await asyncio.sleep(0.02)
            name = f"{self.name}/{self.run_id}/{member.slot}"
            for _ in range(200):  # a replacement waits for its slot's previous actor name to be released
                if self._actor_named(name) is None:
                    break
                await asyncio.sleep(0.05)
            if not self._still_starting(member):
                return
            member.handle = await self._create_actor(name, spec, lambda: self._still_starting(member))
            if member.handle is None:
                return
        try:  # no timeout: Ray places the actor when there is room (the job may be PAUSED until then)
            if info is None:
                info = await asyncio.wrap_future(member.handle.ready.remote(fired).future())
        except Exception as err:  # noqa: BLE001 - the worker could not start (user code in the factory, ...)
            if self.members.get(member.slot) is member and member.state == S.STARTING:
                await self._slot_failed(member, "start", f"worker {member.slot} failed to start: {describe(err)}")
            return
        if self.members.get(member.slot) is not member or member.state != S.STARTING:
            return  # stopped or replaced meanwhile
        member.pid, member.node, member.node_id, member.state = info["pid"], info["node"], info["node_id"], S.READY
        await self._admit()

    async def _create_actor(self, name: str, spec: WorkerSpec, wanted: Callable[[], bool]) -> Optional[Any]:
        """A worker (or spare) actor, created in a thread: registering a named detached actor waits for
        Ray's GCS (measured: 116 ms while the GCS handled a death), and on the event loop that held up
        the survivors' reports and re-form. None, with the actor killed, when it is no longer `wanted`
        once created."""
        handle = await asyncio.to_thread(self._worker_actor(name).remote, spec)
        if not wanted():
            kill(handle)
            return None
        return handle

    def _worker_actor(self, name: str):
        cfg = self.cfg.workers
        lab = {}
        if self.cfg.network.enabled:  # the lab: its connect() shim preloaded (orchestrator/lab.py)
            from actors.lab_shim import worker_env  # noqa: PLC0415 - only lab jobs need it

            lab = {"runtime_env": {"env_vars": worker_env(self.cfg.network)}}
        return WorkerActor.options(name=name, namespace=self.cfg.ray.namespace, lifetime="detached",
                                   num_cpus=cfg.cpus, num_gpus=cfg.gpus, max_restarts=0,
                                   scheduling_strategy="SPREAD" if cfg.placement == "spread" else "DEFAULT", **lab)

    # ------------------------------------------------------------------ hot spares
    def _fill_spares(self) -> None:
        """Start spares until `workers.spares` are up or starting (none while stopping or ended)."""
        if self.state.terminal or self.stop_kind is not None:
            return
        new = []
        while len(self.spares) < self.cfg.workers.spares:
            self.started_spares += 1
            slot = f"spare{self.started_spares}"
            spec = WorkerSpec(self.name, self.run_id, slot, str(self.run_dir), self.name, self.cfg.ray.namespace,
                              self.config_dict, self.search_path, secret=self.secret)
            spare = Spare(f"{self.name}/{self.run_id}/{slot}")
            self.spares.append(spare)
            new.append((spare, spec))
        number = self._persist()
        for spare, spec in new:
            asyncio.get_running_loop().create_task(self._spare_up(spare, spec, number))

    def _fill_spares_when_settled(self) -> None:
        """Start the spares that replace those taken once the membership has settled: no reshape pending
        and no joiner waiting (or after SPARE_SETTLE_S). A spare's start (a process, imports, the
        workload: about a second of CPU) competes with the survivors' re-form and the replacement's join
        for the node's cores; started at the death, it once held a survivor's plan 164 ms and a state load
        140 ms on this 2-core machine."""
        if self._settling is not None and not self._settling.done():
            return

        async def when_settled() -> None:
            deadline = time.monotonic() + SPARE_SETTLE_S
            while (self.pending or self._slots_in(S.STARTING, S.READY)) and time.monotonic() < deadline \
                    and not self.state.terminal:
                await asyncio.sleep(0.05)
            self._fill_spares()
        self._settling = asyncio.get_running_loop().create_task(when_settled())

    async def _spare_up(self, spare: Spare, spec: WorkerSpec, persisted: int) -> None:
        try:
            # its name on disk first: a restarted coordinator kills the spares its dead incarnation started
            if not await asyncio.to_thread(self._saver.wait, persisted, 30):
                raise RuntimeError("its name could not be written to the state file (a restarted coordinator "
                                   "would not find it)")
            spare.handle = await self._create_actor(spare.name, spec, lambda: spare in self.spares)
            if spare.handle is None:  # the job ended (or the spare was dropped) meanwhile
                return
            # no timeout, as for a worker: Ray places it when there is room
            info = await asyncio.wrap_future(spare.handle.ready.remote().future())
        except Exception as err:  # noqa: BLE001 - its start failed: another one starts after a pause
            if spare in self.spares:
                self.spares.remove(spare)
                self._event("info", f"hot spare {spare.status()['name']} failed to start: {describe(err)}")
                await asyncio.sleep(5.0)
                self._fill_spares()
            return
        spare.ready, spare.pid, spare.node, spare.node_id = True, info["pid"], info["node"], info["node_id"]

    async def _adopt_spare(self, member: Member, spec: WorkerSpec, fired: tuple[int, ...]) -> Optional[dict]:
        """The oldest ready spare becomes `member`'s worker (a new spare starts behind it); None when
        no spare is ready or the one taken is gone (the caller starts a fresh actor)."""
        spare = next((s for s in self.spares if s.ready), None)
        if spare is None:
            return None
        self.spares.remove(spare)
        self._fill_spares_when_settled()
        member.handle, member.actor_name = spare.handle, spare.name
        try:
            info = await asyncio.wait_for(asyncio.wrap_future(spare.handle.adopt.remote(spec, fired).future()), 60)
        except Exception as err:  # noqa: BLE001 - the spare died idle, or the replica could not be built
            kill(spare.handle)
            member.handle, member.actor_name = None, ""
            self._event("info", f"hot spare {spare.status()['name']} could not become {member.slot}: {describe(err)}; "
                                f"starting a new worker", slot=member.slot)
            return None
        self._event("info", f"{member.slot} is hot spare {spare.status()['name']} (up for "
                            f"{time.time() - spare.started_at:.1f}s)", slot=member.slot, spare=spare.name)
        return info

    async def _admit(self) -> None:
        """Admit ready workers with one plan, once there are at least `workers.min` members."""
        if self.plan is None or not self.state.active or self.stop_kind is not None:
            return
        ready = sorted(self._slots_in(S.READY), key=slot_index)
        live = self._live_members()
        if not ready or len(live) + len(ready) < self.cfg.workers.min:
            return
        if self._restore is not None and not live and self._slots_in(S.STARTING):
            return  # a restart from a checkpoint resumes at full width, as a fresh start does (admitted once all are up)
        decisions = {self.members[s].join_reason for s in ready}
        if self.state != JobState.PAUSED and any(self.members[s].join_reason in decisions for s in self._slots_in(S.STARTING)):
            return  # joiners of one decision are admitted together: one pause for the others, not several
        if self._departure_pending(live):
            return  # admitted when the survivors' epoch commits (`_complete_reshapes`) or the hold ends
        reason, detector, decided = self.members[ready[0]].join_reason
        restore = None
        if self._restore is not None and not live:  # every member was lost: the first joiner starts from the checkpoint
            restore, self._restore = self._restore, None
            await self._restore_from(ready[0], *restore)
        if joiners_start_stateless(self.algorithm.kind, self.history.step(live)):
            for slot in ready:  # until it loads the committed state (or commits in its epoch)
                self.members[slot].holds_state = slot == ready[0] and restore is not None
        self._reshape(live + tuple(ready), reason, detector, decided, joiners=tuple(ready))
        for slot in ready:
            self._start_run(self.members[slot])

    def _departure_pending(self, live: tuple[str, ...]) -> bool:
        """Whether joiners wait for the survivors of a departure to commit their first step without it.
        A joiner from a hot spare is ready within milliseconds of a death; admitted at once, its plan
        would supersede the survivors' before they commit, and they would wait for its state transfer
        too. Held for at most ADMIT_HOLD_S, and never below `workers.min` (nobody could commit)."""
        held = self._held_departure(live)
        if held:
            asyncio.get_running_loop().call_later(ADMIT_HOLD_S, lambda: asyncio.ensure_future(self._admit()))
        return held

    async def _restore_from(self, slot: str, step: int, path: str) -> None:
        """Every member was lost: `slot`'s fresh worker loads the checkpoint at `step` (the others join
        it and receive the state at their epoch's start); history goes on from `step`, the steps after
        it that it already holds being redone (their new records follow the lost ones)."""
        problem = await asyncio.to_thread(checkpoints.verify, Path(path).with_suffix(".json"))
        if problem:
            raise RuntimeError(f"every member was lost and the checkpoint at step {step} is not whole: {problem} "
                               f"(resume with --resume from an older one)")
        data = await asyncio.to_thread(Path(path).read_bytes)
        await asyncio.wait_for(asyncio.wrap_future(self.members[slot].handle.load_checkpoint.remote(data).future()), 60)
        redone = self.history.restore(step)
        self.step = step
        lost = f"; steps {redone[0]}..{redone[1]} were committed by the lost members and are redone" if redone else ""
        self._event("restore", f"every member was lost: {slot} starts from the checkpoint at step {step}{lost}",
                    step=step, path=path, slot=slot, redone=redone)

    def _held_departure(self, live: tuple[str, ...]) -> bool:
        if self.state == JobState.PAUSED or len(live) < self.cfg.workers.min or self.plan is None:
            return False
        newest = self.plan.membership_epoch
        return any(r["membership_epoch"] == newest and not r["joiners"] and time.time() - r["decided_at"] < ADMIT_HOLD_S
                   for r in self.pending)

    async def _slot_failed(self, member: Member, phase: str, cause: str) -> bool:
        """Count a failure against the slot; retire it past its budget, else (a failed start) start it
        again. True if retired."""
        slot = member.slot
        self.failures[slot] = self.failures.get(slot, 0) + 1
        budget = self.cfg.workers.failure_budget
        if self.failures[slot] >= budget:
            self.retired[slot] = f"retired after {self.failures[slot]} failures (workers.failure_budget = {budget}); last: {cause}"
            member.state, member.cause = S.RETIRED, self.retired[slot]
            if phase == "start":
                self._depart(member)
            self._event("retired", f"slot {slot} {self.retired[slot]}", slot=slot, failures=self.failures[slot])
            return True
        if phase == "start":
            member.state, member.cause = S.FAILED, cause
            self._depart(member)
            self._event("failure", cause, slot=slot, detector="start", failures=self.failures[slot])
            await asyncio.sleep(1.0)
            if not self.state.terminal and self.stop_kind is None:
                self._spawn([slot], f"restart {slot} after: {cause}", "replacement")
        return False

    def _start_run(self, member: Member) -> None:
        member.handle.run.remote()
        member.state = S.TRAINING
        self._start_watch(member)

    def _start_watch(self, member: Member) -> None:
        member.watch_task = asyncio.get_running_loop().create_task(self._watch(member, member.handle.watch.remote()))

    async def _watch(self, member: Member, ref) -> None:
        slot = member.slot
        try:
            outcome = await ref
            kind = "finished" if outcome.get("ok") else "error"
        except (ActorDiedError, RayActorError) as err:
            outcome, kind = {"error": describe(err), "slot": slot}, "died"
        except Exception as err:  # noqa: BLE001
            outcome, kind = {"error": describe(err), "traceback": traceback.format_exc(), "slot": slot}, "error"
        await self.outcomes.put((member, kind, outcome, time.time()))

    # ------------------------------------------------------------------ supervision
    async def _supervise(self) -> None:
        while not self.state.terminal:
            try:
                member, kind, outcome, seen = await asyncio.wait_for(self.outcomes.get(), 0.2)
            except asyncio.TimeoutError:
                self._parent.exit_if_orphaned()
                await self._check_limits()
                continue
            await self._on_outcome(member, kind, outcome, seen)

    def _view(self) -> JobView:
        w = self.cfg.workers
        return JobView(state=self.state, plan_members=self.plan.members if self.plan else (),
                       members={s: m.state for s, m in self.members.items()}, failures=dict(self.failures),
                       min_workers=w.min, failure_budget=w.failure_budget, on_failure=w.on_failure, stop_kind=self.stop_kind,
                       stateless=frozenset(s for s, m in self.members.items() if not m.holds_state),
                       checkpoint_step=self._checkpoint[0] if self._checkpoint and self.algorithm.kind not in SERVER_KINDS
                       else None)

    async def _on_outcome(self, member: Member, kind: str, outcome: dict, seen: float) -> None:
        if self.members.get(member.slot) is not member:
            return  # an earlier incarnation of a slot that was started again
        what = "died" if kind == "died" else "raised an exception"
        detector, cause = member.evicted or ("actor death" if kind == "died" else "task error",
                                             f"worker {member.slot} {what}: {outcome.get('error', '')}".strip())
        hung = member.evicted is not None and member.evicted[0] in ("heartbeat", "step progress")
        d = decide(self._view(), MemberEnded(member.slot, kind, cause, detector, hung))
        if d.ignore:
            return
        member.state = d.member[1]
        if member.state == S.FINISHED and outcome.get("holds_state") is False:
            member.holds_state = False
            self._event("info", f"{member.slot} finished without a state of its own (no live member to receive one "
                                f"from): not one of the final model's replicas", slot=member.slot)
        if member.state in (S.LEFT, S.FINISHED):
            if member.state == S.LEFT:
                kill(member.handle)
            if d.finish:
                await self._finish()
            return
        member.cause = cause
        detail = {"slot": member.slot, "detector": detector, "cause": outcome.get("error", ""), "seen_at": seen,
                  "step": self.step, "membership_epoch": self.epoch}
        if outcome.get("traceback"):
            detail["traceback"] = outcome["traceback"]
        self._abort_epoch(cause)
        kill(member.handle)
        if d.finish:  # the others had all finished: nothing is left to train
            self._event("failure", d.reason, **detail)
            await self._finish()
            return
        if d.end_now is not None:
            await self._end(d.end_now, d.reason, detail=detail)
            return
        if d.restore:
            self._restore = self._checkpoint
        self._event("failure", d.reason if d.restore else cause, **detail)
        if d.count_failure and await self._slot_failed(member, "run", cause):
            member.state = S.RETIRED
        self._depart(member)
        await self._apply(d, cause, detector, seen)
        if d.replace:
            asyncio.get_running_loop().create_task(self._converge(f"replace {member.slot}", "replacement"))

    async def _apply(self, d: Decision, cause: str, detector: str, seen: float) -> None:
        """Carry out a decision's stop, state change and plan."""
        if d.stop_kind is not None and self.stop_kind is None:
            self.stop_kind, self.cause = d.stop_kind, (cause if d.stop_kind == "FAILED" else d.reason)
            self.stop_step = 0 if d.stop_step == "held" else self.step + 1
            if self.server is not None:
                self.server.close(self.cause or d.reason)  # members stop at their next pull
            asyncio.get_running_loop().create_task(self._force_stop_after(self.cfg.comm.timeout_s + 10.0))
            self.faults.die_on_report = True
        if d.transition == JobState.PAUSED:
            self.cause = d.reason
        if d.transition is not None and (d.transition != self.state or d.transition == JobState.PAUSED):
            self._transition(d.transition, d.reason)
        if d.publish is not None:  # a stop decided now publishes the stop; a death re-forms (a reshape)
            if d.stop_kind is not None:
                self._publish(d.publish, d.reason)
            else:
                self._reshape(d.publish, cause, detector, detected_at=seen)

    async def _stop(self, kind: str, reason: str) -> None:
        self._event("info", reason)
        d = decide(self._view(), StopRequested(kind, reason))
        if d.ignore:
            return
        if d.end_now is not None:
            self.stop_kind = d.stop_kind
            await self._end(d.end_now, d.reason, quiet=True)
            return
        await self._apply(d, reason, "stop", time.time())

    async def _check_limits(self) -> None:
        if not self.state.active or self.stop_kind is not None:
            return
        if self.owner_job and time.monotonic() - self._owner_checked >= OWNER_CHECK_S:
            self._owner_checked = time.monotonic()
            if await asyncio.to_thread(job_is_dead, self.owner_job):
                await self._stop("STOPPED", "the process that owned this job (python -m orchestrator run) is gone")
                return
        stop = self.cfg.stop
        if self.state != JobState.PAUSED and stop.time_s is not None and self.running_since \
                and time.time() - self.running_since >= stop.time_s:
            await self._stop("FINISHED", f"time limit of {stop.time_s:g}s reached")

    async def _force_stop_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self.state.terminal:
            self.history.close()
            await self._end(JobState(self.stop_kind or "STOPPED"),
                            f"members did not stop within {delay:.0f}s; their actors were killed", quiet=True)

    # ------------------------------------------------------------------ reshapes
    def _reshape(self, members: tuple[str, ...], reason: str, detector: str, detected_at: float,
                 joiners: tuple[str, ...] = (), leavers: tuple[str, ...] = (), new_epoch: bool = False) -> Plan:
        old = self.plan.members
        if self.state in (JobState.RUNNING, JobState.PAUSED):
            self._transition(JobState.RESHAPING, reason)
        plan = self._publish(members, reason, new_epoch=new_epoch)
        self.pending.append({"membership_epoch": plan.membership_epoch, "old_members": list(old),
                             "new_members": list(members), "joiners": list(joiners), "leavers": list(leavers),
                             "reason": reason, "detector": detector, "decided_at": detected_at,
                             "global_batch": plan.global_batch, "lr_scale": plan.lr_scale,
                             "batch_mode": self.cfg.workers.batch_mode, "state_sources": {}})
        return plan

    async def _converge(self, reason: str, detector: str) -> None:
        """Start or retire workers until the membership matches `target_count` (slots permitting)."""
        async with self._reshape_lock:
            if not self.state.active or self.stop_kind is not None:
                return
            live = list(self._live_members())
            coming = self._slots_in(S.STARTING, S.READY)
            if len(live) + len(coming) < self.target_count:
                taken = set(self._slots_in(S.TRAINING, S.STARTING, S.READY, S.LEAVING))
                joiners = free_slots(self.cfg.workers.max, taken, set(self.retired), self.target_count - len(live) - len(coming))
                if not joiners:
                    self._event("info", f"{reason}: no free slot (retired: {', '.join(sorted(self.retired)) or 'none'})")
                self._spawn(joiners, reason, detector)
            elif len(live) > self.target_count and not coming:
                views = [MemberView(s, self.members[s].compute_s) for s in live]
                leavers = choose_leavers(views, len(live) - self.target_count, self.cfg.workers.scale_down)
                for slot in leavers:
                    self.members[slot].state = S.LEAVING
                self._reshape(tuple(s for s in live if s not in leavers), reason, detector, time.time(), leavers=tuple(leavers))

    async def _heartbeats(self) -> None:
        """Evict a worker that stops answering (SIGSTOP, frozen) or whose step never ends."""
        period = min(1.0, self.cfg.workers.heartbeat_s / 4)
        while not self.state.terminal:
            await asyncio.sleep(period)
            for member in list(self.members.values()):
                if member.state == S.TRAINING and member.evicted is None and (member.beat_task is None or member.beat_task.done()):
                    member.beat_task = asyncio.get_running_loop().create_task(self._beat(member))

    async def _beat(self, member: Member) -> None:
        w = self.cfg.workers
        try:
            info = await asyncio.wait_for(asyncio.wrap_future(member.handle.heartbeat.remote().future()), w.heartbeat_s)
        except asyncio.TimeoutError:
            await self._evict(member, "heartbeat", f"worker {member.slot} did not answer the heartbeat for "
                                                   f"{w.heartbeat_s:g}s (stopped or frozen)")
            return
        except Exception as err:  # noqa: BLE001 - a dead actor: its watch() reports it
            log.debug("heartbeat of %s: %s", member.slot, describe(err))
            return
        stuck_after = self.cfg.comm.timeout_s + 2.0
        if info["phase"] == "waiting" and info["phase_age_s"] > stuck_after and self.state in (JobState.RUNNING, JobState.RESHAPING):
            self._reform(f"worker {member.slot} has waited {info['phase_age_s']:.1f}s for a plan (its group did not form)")
        # A server kind's push has no collective timeout: a push unanswered this long is a hang too.
        waiting = {"compute": "computing", "communicate": "pushing"} if self.algorithm.kind == "server" else {"compute": "computing"}
        if info["phase"] in waiting and info["phase_age_s"] > w.hang_timeout_s:
            await self._evict(member, "step progress", f"worker {member.slot}'s step {info['step']} has been {waiting[info['phase']]} "
                                                       f"for {info['phase_age_s']:.1f}s (workers.hang_timeout_s = {w.hang_timeout_s:g})")

    def _reform(self, reason: str) -> None:
        """Publish the live membership again as a new epoch, after aborting the current one: members
        whose group failed (to form, or in a collective, with every member still alive) start over
        and settle any split commit at the epoch start."""
        if time.monotonic() - self._last_reform < self.cfg.comm.timeout_s:
            return
        self._last_reform = time.monotonic()
        live = self._live_members()
        if live and not any(self.members[s].holds_state for s in live):
            return  # joiners alone cannot form an epoch: the finish or failure of the state's holders decides
        if live:
            self._abort_epoch(reason)
            self._reshape(live, reason, "collective failure", time.time(), new_epoch=True)

    async def _evict(self, member: Member, detector: str, cause: str) -> None:
        if member.state != S.TRAINING or member.evicted is not None:
            return
        member.evicted = (detector, cause)
        self._event("info", f"evicting: {cause}", slot=member.slot, detector=detector)
        if member.node == self.node_ip and member.pid:
            try:  # a stopped process cannot answer Ray's kill request: signal it directly when local
                os.kill(member.pid, signal.SIGKILL)
            except OSError as err:
                log.debug("SIGKILL of %s (pid %s): %s", member.slot, member.pid, err)
        kill(member.handle)
        # Handle it now: Ray may take many seconds to report an actor on a lost node as dead.
        await self.outcomes.put((member, "died", {"error": cause}, time.time()))

    def _complete_reshapes(self, record: dict) -> None:
        """A committed step in a reshape's epoch closes it: one `reshape` event with its duration."""
        epoch = record.get("membership_epoch", 0)
        for reshape in [r for r in self.pending if r["membership_epoch"] <= epoch]:
            self.pending.remove(reshape)
            reshape.update(first_committed_step=record["step"], first_step_at=record["time"],
                           duration_s=record["time"] - reshape["decided_at"])
            for slot in reshape["joiners"]:  # its epoch committed: every member of it entered with the state
                if slot in self.members and self.algorithm.kind != "background":  # no entry: `state_received` says
                    self.members[slot].holds_state = True
            detail = dict(reshape, cause=reshape.pop("reason"))
            self._event("reshape", f"{detail['cause']}: {detail['old_members']} -> {detail['new_members']} "
                        f"({detail['detector']}, {detail['duration_s']:.2f}s)", **detail)
        if not self.pending and self.state == JobState.RESHAPING:
            self.cause = None  # a pause, if there was one, is over
            self._transition(JobState.RUNNING, f"membership epoch {epoch} committed step {record['step']}")
        if self._slots_in(S.READY):  # joiners held back for the survivors' first step (`_departure_pending`)
            asyncio.get_running_loop().create_task(self._admit())

    # ------------------------------------------------------------------ history and limits
    def _accept_record(self, record: dict) -> None:
        if record.get("final"):  # evaluation after the last step: status only, not a history line
            self.metrics.update(record.get("metrics", {}))
            self._check_target()
            return
        newest = self.history.offer(record)
        live = self._live_members() if self.history.reporter == "each" else ()  # only each-member kinds ask
        self.step = max(self.step, self.history.step(live))
        if newest is None:
            return  # a step already in history, a stale report of a redone one, or one ahead of a gap
        if self.pending:
            self._complete_reshapes(record)
        if record.get("loss") is not None:
            self.loss = record["loss"]
        if record.get("metrics"):
            self.metrics = dict(record["metrics"])
        self.recent.append((record["time"], record["step"]))
        while self.recent[0][0] <= record["time"] - 5.0:  # amortised O(1) per record (a rebuilt list was O(window))
            self.recent.popleft()
        self._check_target()

    def _check_target(self) -> None:
        target = self.cfg.stop.target
        if target is None or self.stop_kind is not None or target.metric not in self.metrics:
            return
        value = self.metrics[target.metric]
        if (value >= target.value) if target.mode == "max" else (value <= target.value):
            asyncio.get_running_loop().create_task(
                self._stop("FINISHED", f"target reached: {target.metric} = {value:.4f} ({target.mode} {target.value})"))

    # ------------------------------------------------------------------ plans
    def _live_members(self) -> tuple[str, ...]:
        return tuple(s for s in self.plan.members if self.members[s].state == S.TRAINING) if self.plan else ()

    def _node_of(self, slot: str) -> str:
        """The node a member runs on, for the plan: the lab's virtual node, else its Ray node."""
        if self.cfg.network.enabled:
            return f"lab{self.cfg.network.node_of(slot)}"
        member = self.members.get(slot)
        return member.node_id if member is not None else ""

    def _publish(self, members: tuple[str, ...], reason: str, new_epoch: bool = False) -> Plan:
        self._take_store()
        self.version += 1
        global_batch, lr_scale = batch_for(len(members), self.cfg.workload.batch_size, self.cfg.workers.count,
                                           self.cfg.workers.batch_mode)
        previous = self.plan
        # Decentralized kind: no vote is reduced over every member, so members cannot switch plans
        # together at a step; every new plan is a new epoch, and the old one is aborted (below).
        if previous is None or previous.members != members or new_epoch or self.algorithm.kind == "decentralized":
            self.epoch += 1
        plan = Plan(
            version=self.version, membership_epoch=self.epoch, members=members,
            group_name=f"{self.name}/{self.run_id}/c{self.incarnation}/e{self.epoch}",
            store_host=self.node_ip, store_port=self.store_port, timeout_s=self.cfg.comm.timeout_s,
            global_batch=global_batch, lr_scale=lr_scale,
            backend="nccl" if self.cfg.workers.gpus > 0 and self.cfg.comm.backend != "gloo" else "gloo",
            stop_step=self.stop_step, reason=reason, history_step=self.history.written_step,
            nodes=tuple(self._node_of(slot) for slot in members))
        if previous is None or plan.membership_epoch != previous.membership_epoch:
            self.epoch_keys.entered(plan.group_name, len(members), plan.backend)  # older epochs' keys go
        self.plan = plan
        if self.server is not None:  # the server admits a membership before its members pull under it
            self._tell_server(members)
        sent = [m.handle.set_plan.remote(plan) for m in self.members.values()
                if m.state in (S.TRAINING, S.READY, S.LEAVING)]  # leavers too: the plan is how they learn to leave
        self.faults.maybe_die("publish", plan.version, sent)
        self._persist()
        if previous is not None and self.algorithm.kind == "decentralized":
            for member in self.members.values():  # the old epoch's number: a member already in the new one is left alone
                if member.state in (S.TRAINING, S.READY, S.LEAVING):
                    member.handle.abort_epoch.remote(previous.membership_epoch, f"plan {plan.version}: {reason}")
        return plan

    def _abort_epoch(self, reason: str) -> None:
        for member in self.members.values():
            if member.state in (S.TRAINING, S.READY, S.LEAVING):
                member.handle.abort_epoch.remote(self.epoch, reason)

    # ------------------------------------------------------------------ endings
    async def _finish(self) -> None:
        """Every member of the plan finished at the same committed step: keep the model, end the job."""
        if self.server is not None:  # its newest reports may still be on their way
            if self.algorithm.kind == "background":
                self.server.close("the job ended")  # the dispenser requeues what is still held (counted)
            for record in await self.server.records_after(self.history.written_step):
                self._accept_record(record)
            await self.server.refresh_summary()
        self.history.close()
        self.step = self.history.step([s for s in self.plan.members if self.members[s].holds_state]) \
            if self.history.reporter == "each" and self.plan else self.history.written_step
        kind = JobState(self.stop_kind or "FINISHED")
        # Every holder has the committed state: rank 0 of the plan, unless it died after the others finished.
        ranked = [self.members[s] for s in self.plan.members] + list(self.members.values()) if self.plan else []
        rank0 = next((m for m in ranked if m.holds_state and m.state in (S.FINISHED, S.TRAINING)), None)
        if self.plan is not None or self.server is not None:
            try:
                if self.algorithm.final_model == "average":
                    blob = await self._average_of_replicas()
                elif rank0 is None and self.server is None:
                    raise RuntimeError("no live member holds the committed state")
                else:
                    blob = await (self.server.model_state() if self.server is not None else
                                  asyncio.wait_for(asyncio.wrap_future(rank0.handle.final_state.remote().future()), 60))
                runfiles.write_bytes_atomic(self.run_dir / "model.pt", blob)
                if kind != JobState.FINISHED:  # a stopped or failed job can be continued with --resume
                    await asyncio.to_thread(checkpoints.save, self.run_dir, self.step, blob, self.cfg.checkpoint.keep)
                    self._event("checkpoint", f"checkpoint at step {self.step} on {kind.value.lower()}", step=self.step)
            except Exception as err:  # noqa: BLE001
                self._event("info", f"could not fetch the final model from {'the server' if self.server else getattr(rank0, 'slot', 'a member')}: "
                                    f"{first_line(err)}")
        final = await self._member_states(self.plan.members) if kind == JobState.FAILED and self.plan else {}
        if kind == JobState.FINISHED:
            self.cause = None
        await self._end(kind, self.cause or f"all members reached the stop step {self.step}", quiet=True,
                        survivors=final or None)

    async def _average_of_replicas(self) -> bytes:
        """The final model of the kinds whose replicas differ: the average over the members that finished
        (a member that finished first is no longer in the newest plan) and those of the plan still
        training, with the first one's other state."""
        holders = [m for m in self.members.values()
                   if m.state == S.FINISHED or (m.state == S.TRAINING and m.slot in self.plan.members)]
        holders = [m for m in holders if m.holds_state]  # never a replica that never trained or loaded a state
        if not holders:
            raise RuntimeError("no member holds a trained replica")
        blobs = await asyncio.gather(*(asyncio.wait_for(asyncio.wrap_future(m.handle.final_state.remote().future()), 60)
                                       for m in holders))
        blob = await asyncio.to_thread(checkpoints.average_states, list(blobs))
        metrics = await ask(holders[0].handle, "evaluate_state", blob, timeout=60) or {}
        if metrics:
            self.metrics.update(metrics)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self._event("info", f"final model: the average of {len(holders)} replicas ({', '.join(m.slot for m in holders)})"
                            + (f": {shown}" if shown else ""), replicas=[m.slot for m in holders], metrics=metrics)
        return blob

    async def _member_states(self, slots: tuple[str, ...]) -> dict:
        """Each member's committed (step, checksum), straight from the worker."""
        out = {}
        for slot in slots:
            info = await ask(self.members[slot].handle, "status", timeout=3.0)
            out[slot] = {"step": info["step"], "checksum": info["checksum"]} if info else {"error": "no answer"}
        return out

    async def _end(self, state: JobState, reason: str, detail: Optional[dict] = None, quiet: bool = False,
                   survivors: Optional[dict] = None) -> None:
        """Tear every actor of the job down and enter a terminal state (FAILED records the failure)."""
        if state == JobState.FAILED and not quiet:
            self.cause = reason
            self._event("failure", reason, **(detail or {}))
        self.history.close()
        if self.server is not None:
            self.server.kill()
        for spare in self.spares:
            kill(spare.handle)
        self.spares = []
        for member in self.members.values():
            kill(member.handle)
            if not member.state.departed:
                member.state = S.FINISHED if member.state == S.FINISHED else S.STOPPED
        self._transition(state, reason, **({"survivors": survivors} if survivors else {}))
        runfiles.write_json_atomic(self.run_dir / "status.json", self._status().to_dict())

    async def _linger(self) -> None:
        if self.owner_job and await asyncio.to_thread(job_is_dead, self.owner_job):
            self._released.set()  # its owner is gone: nobody will read the result from this actor
        try:
            await asyncio.wait_for(self._released.wait(), LINGER_S)
        except asyncio.TimeoutError:
            pass
        self.history.shut()
        self._events.close()
        self._saver.close()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ------------------------------------------------------------------ bookkeeping
    def _transition(self, to: JobState, reason: str, **detail: Any) -> None:
        self._event("transition", reason, state_from=self.state.value, state_to=to.value, **detail)
        self.state = to
        if to.terminal:
            self.ended_at = time.time()
        number = self._persist()
        if to.terminal:
            self._saver.wait(number, timeout=30)  # on disk before the driver, told the job ended, reads it
            runfiles.publish_record(self.name, {"run_id": self.run_id, "run_dir": str(self.run_dir), "state": to.value})

    def _event(self, kind: str, reason: str, state_from: Optional[str] = None, state_to: Optional[str] = None, **detail: Any) -> None:
        event = Event(time=time.time(), kind=kind, reason=reason, state_from=state_from, state_to=state_to, detail=detail)
        self.events.append(event)
        self._events.write(json.dumps(event.to_dict()) + "\n")
        self._events.flush()

    def _member_status(self, m: Member) -> MemberStatus:
        rank = self.plan.rank_of(m.slot) if self.plan else None
        return MemberStatus(slot=m.slot, rank=-1 if rank is None or m.state.departed else rank, node=m.node,
                            pid=m.pid, state=m.state.value, cause=m.cause, node_id=m.node_id,
                            actor_id=m.handle._actor_id.hex() if m.handle is not None else "")

    def _recent_reshapes(self) -> tuple[Event, ...]:
        recent: list[Event] = []
        for event in reversed(self.events):
            if event.kind == "reshape":
                recent.append(event)
                if len(recent) == RESHAPES_SHOWN:
                    break
        return tuple(reversed(recent))

    def _depart(self, member: Member) -> None:
        self.departed = (self.departed + [self._member_status(member)])[-20:]

    def _status(self) -> JobStatus:
        plan = self.plan
        throughput = None
        if len(self.recent) >= 2 and self.recent[-1][0] > self.recent[0][0]:
            throughput = (self.recent[-1][1] - self.recent[0][1]) / (self.recent[-1][0] - self.recent[0][0])
        return JobStatus(name=self.name, run_id=self.run_id, state=self.state.value, step=self.step,
                         membership_epoch=self.epoch, world_size=len(plan.members) if plan else 0,
                         members=tuple(self._member_status(m) for m in self.members.values()),
                         loss=self.loss, throughput=throughput, cause=self.cause, run_dir=str(self.run_dir),
                         metrics=dict(self.metrics), reshapes=self._recent_reshapes(),
                         departed=tuple(self.departed), incarnation=self.incarnation, coordinator_pid=os.getpid(),
                         started_at=self.started_at, ended_at=self.ended_at,
                         stragglers={slot: round(r, 3) for slot, r in self.stragglers.current.items()},
                         server=dict(self.server.summary, restarts=self.server.restarts) if self.server else {},
                         topology=self._topology(plan), spares=tuple(s.status() for s in self.spares))

    def _topology(self, plan) -> dict:
        """A gossip policy's topology over the plan's members and its spectral gap there."""
        config = getattr(self.cfg.sync, "topology", None)
        if config is None or plan is None:
            return {}
        n = len(plan.members)
        if self._gap is None or self._gap[0] != n:
            self._gap = (n, spectral_gap(get_topology(config.kind, **config.params()), n))
        return {"kind": config.kind, "world_size": n, "spectral_gap": round(self._gap[1], 6)}


CoordinatorActor = ray.remote(num_cpus=0)(Coordinator)


SELF_CALL_DEADLINE_S = 60.0
"""A restarted coordinator whose own `start` is not taken within this long kills itself (Ray restarts it)."""


def call_self_when_alive(name: str, namespace: str, method: str, deadline_s: float = SELF_CALL_DEADLINE_S,
                         call: Optional[Callable[[], Any]] = None,
                         give_up: Optional[Callable[[], None]] = None) -> threading.Thread:
    """Call `method` of this restarted actor once it accepts calls, from a thread of its own.

    A call an actor sends itself from `__init__` during a restart can reach Ray's submitter while
    the actor is still RESTARTING; Ray then fails it ("the actor is restarting") and does not retry
    it, and a coordinator whose `start` is lost never runs (seen in CI as a job that hung after a
    coordinator restart). So the call is made again until it returns (`start` is idempotent). Past
    `deadline_s`, `give_up` runs: by default the process kills itself, Ray restarts it, and the next
    incarnation tries again. `call` replaces the Ray call (tests)."""

    def ray_call() -> Any:
        return ray.get(getattr(ray.get_actor(name, namespace=namespace), method).remote(), timeout=30)

    def kill_self() -> None:
        log.error("%s.%s was not taken within %.0fs: this incarnation exits and Ray restarts it", name, method, deadline_s)
        os.kill(os.getpid(), signal.SIGKILL)

    def run() -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                (call or ray_call)()
                return
            except (RayActorError, ray.exceptions.GetTimeoutError, ValueError) as err:  # not accepting calls yet
                log.warning("%s.%s not taken yet (%s); asking again", name, method, first_line(err))
                time.sleep(0.2)
        (give_up or kill_self)()

    thread = threading.Thread(target=run, name=f"call-self-{method}", daemon=True)
    thread.start()
    return thread


def _in_thread(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """`fn(*args)` in a daemon thread of its own; its result (or exception) in the returned future."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits for it
            future.set_exception(err)

    threading.Thread(target=run, name=getattr(fn, "__name__", "in_thread"), daemon=True).start()
    return future
