"""The coordinator's main task, from its start to its end.

A first incarnation starts the job (the parameter server where the kind has one, the first
members, their first plan); a restarted one re-attaches to the workers that stayed alive and
publishes a newer epoch. Then the loop: the supervisor's batches of worker outcomes, and between
them the owner check, the job's limits and the mirror. A stop that members do not reach in time is
forced; every end tears the job's actors down, enters a terminal state and lingers for `status`,
then ends every task the coordinator's parts started (actors/control/tasks.py). A main task that is
cancelled does nothing more, as a process that is gone. `Lifecycle` owns the main task, the
parameter server's control (started here, or attached to by a restarted incarnation) and the
release that lets a finished coordinator go; the parts it drives are passed in.
"""
from __future__ import annotations

import asyncio
import os
import time
import traceback
from typing import Any

from actors.control.book import MembershipBook
from actors.control.endings import wrap_up
from actors.control.history import History
from actors.control.job_state import JobStateMachine
from actors.control.journal import Journal
from actors.control.keys import RendezvousKey
from actors.control.launcher import Launcher, NoWorkerCanStart
from actors.control.plans import Plans
from actors.control.records import Records
from actors.control.restart import StateFile, reattach, records_since, resume
from actors.control.run_identity import RunIdentity
from actors.control.server_control import ServerControl
from actors.control.spares import SparePool
from actors.control.supervisor import Supervisor
from actors.control.tasks import Tasks
from actors.control.workers import WorkerGroup
from actors.faults import CoordinatorFaults
from actors.observe.metrics import JobMetrics
from actors.observe.report import draw_at_end
from actors.plan import ParentWatch
from algorithms.rules.kinds import PolicyTraits
from algorithms.rules.supervision import JobState, MemberState, recovered_epoch
from algorithms.rules.topologies import topology_status
from core.schema import JobStatus

OWNER_CHECK_S = 1.0
LINGER_S = 600.0
"""A finished coordinator stays this long for `status`, unless released earlier."""
FORCE_STOP_AFTER_S = 10.0
"""A stop's grace beyond `comm.timeout_s`: members that have not stopped by then are killed."""
S = MemberState


class Lifecycle:
    """The main task of a `Coordinator`: start or recover, the loop, limits, and the end."""

    def __init__(self, run: RunIdentity, algorithm: PolicyTraits, group: WorkerGroup, journal: Journal,
                 history: History, book: MembershipBook, job: JobStateMachine, state_file: StateFile,
                 launcher: Launcher, spares: SparePool, supervisor: Supervisor, plans: Plans, records: Records,
                 metrics: JobMetrics, faults: CoordinatorFaults, keys: RendezvousKey, parent: ParentWatch,
                 tasks: Tasks) -> None:
        self.run, self.cfg, self.algorithm, self.group, self.journal = run, run.cfg, algorithm, group, journal
        self.history, self.book, self.job, self.state_file = history, book, job, state_file
        self.launcher, self.spares, self.supervisor, self.plans, self.records = launcher, spares, supervisor, plans, records
        self.metrics, self.faults, self.keys, self._parent, self.tasks = metrics, faults, keys, parent, tasks
        self.main_task: asyncio.Task | None = None
        self.released: asyncio.Event | None = None
        """Set by the driver's release (or once the owner is gone): a terminal coordinator exits now."""
        self._owner_checked = 0.0
        self.server: ServerControl | None = None
        """The parameter server's control (server kinds), from the start (or a restart's attach) to the end."""
        if state_file.saved is not None:
            self.group.start_self(run.name, self.cfg.ray.namespace)  # nobody else will
            if algorithm.kind.runs_server:  # detached: it trained on without us
                self.server = ServerControl.attach(self.cfg, run.run_id)

    def start(self) -> None:
        """The main task, on the running loop (once)."""
        self.released = asyncio.Event()
        self.main_task = asyncio.get_running_loop().create_task(self._main())

    def release(self) -> None:
        """Let a terminal coordinator exit now (the driver has read the result)."""
        if self.released is not None:
            self.released.set()

    def status(self) -> JobStatus:
        """The job's status, as `status` answers and `status.json` keeps at the end."""
        plan, job, server = self.book.plan, self.job, self.server
        return JobStatus(name=self.run.name, run_id=self.run.run_id, state=job.state.value, step=self.journal.step,
                         membership_epoch=self.book.epoch, world_size=len(plan.members) if plan else 0,
                         members=tuple(self.book.member_status(m, self.group.actor_id(m.handle))
                                       for m in self.book.members.values()),
                         loss=self.journal.loss, throughput=self.journal.throughput(),
                         tokens_per_s=self.journal.tokens_throughput(),
                         worker_tokens_per_compute_s=self.journal.worker_tokens_per_compute_s(), mfu=self.journal.mfu,
                         cause=job.cause,
                         run_dir=str(self.run.run_dir), metrics=dict(self.journal.metrics),
                         step_metrics=dict(self.journal.newest_of.get("step_metrics", {})),
                         tensor_bytes=dict(self.journal.newest_of.get("tensor_bytes", {})),
                         reshapes=self.journal.recent_reshapes(), departed=tuple(self.book.departed),
                         incarnation=self.run.incarnation, coordinator_pid=os.getpid(),
                         started_at=job.started_at, ended_at=job.ended_at,
                         stragglers={slot: round(r, 3) for slot, r in self.supervisor.stragglers.current.items()},
                         server=dict(server.summary, restarts=server.restarts) if server else {},
                         topology=topology_status(getattr(self.cfg.sync, "topology", None), plan), spares=self.spares.status(),
                         checkpoint=self.journal.checkpoints.status(), samples_skipped=len(self.journal.skipped))

    # ------------------------------------------------------------------ the main task
    async def _main(self) -> None:
        try:
            try:
                await self._run()
            except Exception:
                await self._linger()  # ending the job failed: it lingers all the same, then says why
                raise
            await self._linger()
        except asyncio.CancelledError:
            # Its event loop is closing (a test's, a benchmark's), or a test plays the process's death. As
            # with a process that is gone, nothing more happens: no report, no linger for a release (one
            # in the cancelled task held such a loop's close for LINGER_S), none of its tasks runs on.
            self.tasks.cancel()
            raise

    async def _run(self) -> None:
        """From the start (or a restart's recovery) until the job ends; an error fails the job."""
        try:
            try:
                await (self._recover() if self.state_file.saved is not None else self._begin())
            finally:
                self.state_file.recovered.set()
                self.state_file.save()  # the members it re-attached (saved before as the dead incarnation left them)
            self.tasks.spawn(self.supervisor.heartbeats())
            while not self.job.state.terminal:
                batch = await self.supervisor.outcomes.next(0.2)
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
            if not self.job.state.terminal:
                await self.end(JobState.FAILED, str(err))
        except Exception as err:  # noqa: BLE001 - the job fails with the cause, never hangs
            if not self.job.state.terminal:
                await self.end(JobState.FAILED, f"coordinator error: {type(err).__name__}: {err}",
                               detail={"traceback": traceback.format_exc()})

    async def _begin(self) -> None:
        if self.cfg.policy_choice:  # sync.policy: auto, resolved by the driver (orchestrator/planner.py)
            self.journal.event("info", self.cfg.policy_choice, policy=self.cfg.sync.policy)
        if self.algorithm.kind.runs_server:  # it holds the initial state and the first membership before any pull
            self.server = await ServerControl.start(self.cfg, self.run.config, self.run.run_id, str(self.run.run_dir))
            what = self.algorithm.kind.server_role
            self.journal.event("info", f"{what} started (pid {self.server.pid})", pid=self.server.pid)
        self.launcher.spawn([f"w{i}" for i in range(self.cfg.workers.count)], "initial membership", "start")
        members = await self.launcher.first_members(self._starting)
        if self.run.resume_from:
            await resume(self.run.resume_from, self.book.members[members[0]], self.group, self.server, self.history,
                         self.journal)
        self.plans.publish(members, "initial membership")
        for slot in members:
            self.supervisor.run(self.book.members[slot])
        self.job.running()
        self.job.transition(JobState.RUNNING, f"{len(members)} workers started and received the first plan")
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
        saved = self.state_file.saved
        if saved is None:
            raise RuntimeError("recover: no state file was loaded")
        found, lost, epochs = await reattach(saved, self.book, self.group, self.run.prefix, self.supervisor.watch)
        server_epoch = 0
        if self.server is not None:
            await self.server.refresh_summary()
            server_epoch = int((self.server.summary or {}).get("membership_epoch", 0))
        self.book.carry_on(recovered_epoch(self.book.epoch, epochs, server_epoch))
        for record in await records_since(found, self.book, self.group, self.history.written_step):
            self.records.accept(record)
        if self.server is not None:  # what it reported while no coordinator listened
            for record in await self.server.records_after(self.history.written_step):
                self.records.accept(record)
        self.journal.event("restart", f"coordinator restarted as incarnation {self.run.incarnation}: re-attached "
                           f"{', '.join(found) or 'no worker'}" + (f"; lost {', '.join(lost)}" if lost else ""),
                           incarnation=self.run.incarnation, reattached=found, lost=lost, history_step=self.journal.step)
        live = self.book.live()
        if not live:
            raise RuntimeError("restarted and found no live worker holding the committed state (resume with --resume)")
        if self.job.stop_kind is None:
            self.plans.reshape(live, f"coordinator restarted (incarnation {self.run.incarnation})", "coordinator restart",
                               decided, new_epoch=True)
            await self.plans.converge("replace workers lost while the coordinator was down", "replacement")
        else:
            self.plans.publish(live, self.job.cause or "stopping", new_epoch=True)
        self.spares.fill()

    def _starting(self, unplaced: bool, cause: str) -> None:
        """Below workers.min after pause_after_s (the launcher's `first_members`): PAUSED while some worker
        cannot be placed, STARTING (with how many are up) while the placed ones start."""
        job = self.job
        if unplaced:
            if cause != job.cause:
                job.set_cause(cause)
                if job.state == JobState.STARTING:
                    job.transition(JobState.PAUSED, cause)
            return
        job.set_cause(cause)
        if job.state == JobState.PAUSED:
            job.transition(JobState.STARTING, "every worker is placed: " + cause)

    # ------------------------------------------------------------------ limits
    async def _check_limits(self) -> None:
        if not self.job.state.active or self.job.stop_kind is not None:
            return
        owner = self.run.owner_job
        if owner and time.monotonic() - self._owner_checked >= OWNER_CHECK_S:
            self._owner_checked = time.monotonic()
            if await asyncio.to_thread(self.group.job_is_dead, owner):
                await self.supervisor.stop("STOPPED", "the process that owned this job (python -m orchestrator run) is gone")
                return
        stop = self.cfg.stop
        since = self.job.running_since
        if self.job.state != JobState.PAUSED and stop.time_s is not None and since and time.time() - since >= stop.time_s:
            await self.supervisor.stop("FINISHED", f"time limit of {stop.time_s:g}s reached")

    async def _force_stop_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self.job.state.terminal:
            self.history.close()
            # Members stuck in a step: those on this node are SIGKILLed, gone before the job reports its
            # end, not once Ray's kill reaches them (a run of the suite here saw two alive 0.5 s after stop()).
            for member in self.book.members.values():
                if member.state.live:
                    self.group.kill_process(member.node, member.pid)
            await self.end(JobState(self.job.stop_kind or "STOPPED"),
                           f"members did not stop within {delay:.0f}s; their actors were killed", quiet=True)

    def begin_stop(self, kind: str, cause: str, stop_step: int) -> None:
        """A stop is decided (the supervisor's): every plan carries `stop_step`, the server closes, and members
        that have not stopped within the grace are killed."""
        self.job.decide_stop(kind, cause)
        self.book.stop_at(stop_step)
        if self.server is not None:
            self.server.close(cause)  # members stop at their next pull
        self.tasks.spawn(self._force_stop_after(self.cfg.comm.timeout_s + FORCE_STOP_AFTER_S))
        self.faults.stopping()

    # ------------------------------------------------------------------ endings
    async def finish(self) -> None:
        """Every member of the plan finished at the same committed step: keep the model, end the job."""
        kind = JobState(self.job.stop_kind or "FINISHED")
        survivors = await wrap_up(kind, self.algorithm, self.book, self.group, self.server, self.history,
                                  self.journal, self.records.accept)
        if kind == JobState.FINISHED:
            self.job.set_cause(None)
        await self.end(kind, self.job.cause or f"all members reached the stop step {self.journal.step}", quiet=True,
                       survivors=survivors)

    async def end(self, state: JobState, reason: str, detail: dict | None = None, quiet: bool = False,
                  survivors: dict | None = None) -> None:
        """Tear every actor of the job down and enter a terminal state (FAILED records the failure)."""
        if state == JobState.FAILED and not quiet:
            self.job.set_cause(reason)
            self.journal.event("failure", reason, **(detail or {}))
        self.history.close()
        if self.server is not None:
            self.server.kill()
        self.spares.kill_all()
        self.group.release_data(self.run.name, self.run.run_id)
        for member in self.book.members.values():
            self.group.kill(member.handle)
            if not member.state.departed:
                member.move(S.FINISHED if member.state == S.FINISHED else S.STOPPED)
        detail_: dict[str, Any] = {"survivors": survivors} if survivors else {}
        self.job.transition(state, reason, **detail_)
        self.journal.write_status(self.status().to_dict())

    async def _linger(self) -> None:
        # the run report (actors/observe/report.py), before the driver's release lets this process go
        run_dir = self.run.run_dir
        await asyncio.to_thread(draw_at_end, run_dir, self.cfg.tracking.report, self.journal.event)
        if (run_dir / "report.png").exists():
            self.journal.put("report.png")
        released = self.released
        if released is None:
            raise RuntimeError("linger: the coordinator was never started")
        owner = self.run.owner_job
        orphaned = await asyncio.to_thread(self.group.job_is_dead, owner) if owner else False
        if orphaned:
            released.set()  # its owner is gone: nobody will read the result from this actor
        try:
            await asyncio.wait_for(released.wait(), LINGER_S)
        except asyncio.TimeoutError:
            pass
        await self.tasks.close()  # those left (the forced stop's timer, heartbeats, holds) end, within a bound
        self.journal.close()
        self.keys.forget()  # the rendezvous key and the storage credentials
        self.group.exit()

