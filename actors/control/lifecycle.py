"""The coordinator's main task, from its start to its end.

A first incarnation starts the job (the parameter server where the kind has one, the first
members, their first plan); a restarted one re-attaches to the workers that stayed alive and
publishes a newer epoch. Then the loop: the supervisor's batches of worker outcomes, and between
them the owner check, the job's limits and the mirror. A stop that members do not reach in time is
forced; every end tears the job's actors down, enters a terminal state and lingers for `status`,
then ends every task the coordinator's parts started (actors/control/tasks.py). A main task that is
cancelled does nothing more, as a process that is gone. `Lifecycle` is a mixin over `CoordinatorBase`
(actors/control/base.py).
"""
from __future__ import annotations

import asyncio
import time
import traceback
from typing import Any

from actors.control.base import CoordinatorBase
from actors.control.endings import wrap_up
from actors.control.launcher import NoWorkerCanStart
from actors.control.restart import reattach, records_since, resume
from actors.control.server_control import ServerControl
from actors.observe.report import draw_at_end
from algorithms.rules.supervision import JobState, MemberState, recovered_epoch

OWNER_CHECK_S = 1.0
LINGER_S = 600.0
"""A finished coordinator stays this long for `status`, unless released earlier."""
S = MemberState


class Lifecycle(CoordinatorBase):
    """The main task of a `Coordinator`: start or recover, the loop, limits, and the end."""

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
                await (self._recover() if self._saved is not None else self._begin())
            finally:
                self._recovered.set()
                self._persist()  # the members it re-attached (saved before as the dead incarnation left them)
            self.tasks.spawn(self.supervisor.heartbeats())
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

    async def _begin(self) -> None:
        if self.cfg.policy_choice:  # sync.policy: auto, resolved by the driver (orchestrator/planner.py)
            self.journal.event("info", self.cfg.policy_choice, policy=self.cfg.sync.policy)
        if self.algorithm.kind.runs_server:  # it holds the initial state and the first membership before any pull
            self.server = await ServerControl.start(self.cfg, self.config_dict, self.run_id, str(self.run_dir))
            what = self.algorithm.kind.server_role
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
        if self._saved is None:
            raise RuntimeError("recover: no state file was loaded")
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

    # ------------------------------------------------------------------ limits
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
        detail_: dict[str, Any] = {"survivors": survivors} if survivors else {}
        self.transition(state, reason, **detail_)
        self.journal.write_status(self._status().to_dict())

    async def _linger(self) -> None:
        # the run report (actors/observe/report.py), before the driver's release lets this process go
        await asyncio.to_thread(draw_at_end, self.run_dir, self.cfg.tracking.report, self.journal.event)
        if (self.run_dir / "report.png").exists():
            self.journal.put("report.png")
        released = self._released
        if released is None:
            raise RuntimeError("linger: the coordinator was never started")
        owner = self.owner_job
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

