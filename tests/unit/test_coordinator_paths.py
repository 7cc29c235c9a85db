"""The coordinator's decision paths, driven one event at a time through a fake worker group (no Ray).

Each test builds the real `Coordinator` over `FakeWorkerGroup`, starts it on the test's event loop,
makes things happen to workers (a death, a hang, a start that fails, no resources) and commits steps
as rank 0 would report them, then checks what the coordinator decided: its plans, events, state
file and final state. These were end-to-end tests of whole jobs before; what they check does not
depend on training, so here each takes well under a second of work.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from actors.control.coordinator import Coordinator
from algorithms.rules.supervision import JobState
from orchestrator.config import config_from_dict
from testkit.fake_workers import FakeWorkerGroup
from testkit.job_checks import until


def config(name: str, **over: Any) -> dict:
    cfg = {"name": name, "seed": 0,
           "workers": {"count": 3, "cpus": 0.5, "heartbeat_s": 2.0, "start_grace_s": 0.2, "pause_after_s": 0.2},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 8}, "batch_size": 8},
           "stop": {"max_steps": 1_000_000}, "eval_every": 0}
    for key, value in over.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return config_from_dict(cfg).to_dict()


RUNNING_NOW: list[Coordinator] = []


def coordinator(cfg: dict, run_dir: Path, group: FakeWorkerGroup) -> Coordinator:
    coord = Coordinator(cfg, "r1", str(run_dir), group=group)
    RUNNING_NOW.append(coord)
    return coord


async def started(cfg: dict, run_dir: Path, group: FakeWorkerGroup) -> Coordinator:
    coord = coordinator(cfg, run_dir, group)
    await coord.start()
    await until(lambda: coord.job.state == JobState.RUNNING, "RUNNING")
    return coord


async def ended(coord: Coordinator, timeout: float = 10.0) -> JobState:
    await until(lambda: coord.job.state.terminal, "a terminal state", timeout)
    await coord.release()
    await asyncio.wait_for(coord.lifecycle.main_task, 5)
    return coord.job.state


async def stopped(coord: Coordinator, group: FakeWorkerGroup, steps: int = 2) -> None:
    """A stop asked for, the steps up to the stop step committed: the job ends STOPPED."""
    await coord.request_stop()
    await group.commit(coord, steps)
    assert await ended(coord) == JobState.STOPPED


def events(coord: Coordinator, kind: str = "") -> list:
    return [e for e in coord.journal.events if not kind or e.kind == kind]


def run(scenario) -> Any:
    """The scenario on a fresh event loop, failing after 25 s, and what it returns; a coordinator left
    running (the scenario failed) is released, so that its linger (which waits for a driver's release)
    does not hold the test."""
    async def guarded():
        try:
            return await asyncio.wait_for(scenario, 25)
        finally:
            for coord in RUNNING_NOW:
                coord.lifecycle.release()
                if coord.lifecycle.main_task is not None and not coord.lifecycle.main_task.done():
                    coord.lifecycle.main_task.cancel()
            RUNNING_NOW.clear()
    return asyncio.run(guarded())


def test_a_job_starts_commits_and_finishes_at_max_steps(tmp_path):
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("plain", stop={"max_steps": 5}), tmp_path, group)
        assert coord.book.plan.members == ("w0", "w1", "w2") and coord.book.plan.membership_epoch == 1
        assert all(group.current(s).plan == coord.book.plan for s in ("w0", "w1", "w2")), "every member got the plan"
        await group.commit(coord, 10)
        assert await ended(coord) == JobState.FINISHED
        assert [json.loads(line)["step"] for line in (tmp_path / "history.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
        assert (tmp_path / "model.pt").read_bytes() == b"fake-state"
    run(scenario())


@pytest.mark.parametrize("policy", ["bsp", "local_sgd", "dpsgd"])  # (shadow starts a real lease dispenser)
def test_each_plan_names_the_group_store_of_its_rank_0(tmp_path, policy):
    """The members of an epoch rendezvous on the store their rank 0 serves (each worker serves one; the
    coordinator none, so it never loads torch): the first plan names w0's, the survivors' of w0's
    death w1's."""
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("store", sync={"policy": policy}), tmp_path, group)
        plan = coord.book.plan
        assert (plan.store_host, plan.store_port) == ("127.0.0.1", group.current(plan.members[0]).pid)
        await group.commit(coord, 3)
        group.die("w0")
        await until(lambda: "w0" not in coord.book.plan.members, "the survivors' plan")
        plan = coord.book.plan
        assert plan.members[0] == "w1" and plan.store_port == group.current("w1").pid
    run(scenario())


async def death_and_replacement(coord: Coordinator, group: FakeWorkerGroup, before: int, between: int) -> int:
    """`before` steps; w1 dies; the survivors' plan; `between` steps (the first admits the replacement);
    the replacement's plan. Returns the survivors' membership epoch."""
    await group.commit(coord, before)
    group.die("w1")
    await until(lambda: coord.book.plan.members == ("w0", "w2"), "the survivors' plan")
    survivors_epoch = coord.book.plan.membership_epoch
    await group.commit(coord, between)
    await until(lambda: coord.book.plan.members == ("w0", "w2", "w1"), "the replacement's plan")
    return survivors_epoch


def test_a_death_re_forms_the_survivors_and_a_replacement_joins(tmp_path):
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("death"), tmp_path, group)
        survivors_epoch = await death_and_replacement(coord, group, 3, 1)
        assert group.current("w0").aborted == [1] and survivors_epoch == 2
        await group.commit(coord, 1)
        await until(lambda: coord.job.state == JobState.RUNNING, "RUNNING again")
        reshapes = [e.detail["detector"] for e in events(coord, "reshape")]
        assert reshapes == ["actor death", "replacement"], reshapes
        await stopped(coord, group, 2)
    run(scenario())


def test_stop_while_paused_stops_the_survivors_at_their_committed_step(tmp_path):
    """A death takes the job below workers.min with the slot retired (budget 1): PAUSED. A stop
    then publishes the survivors' plan with the 'held' stop step (0): they stop where they are, and
    the job saves their state (model and checkpoint). Without the held stop step they would be told
    to train one more step, which a job below its minimum never commits: the stop would hang."""
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("paused", workers={"min": 3, "failure_budget": 1}), tmp_path, group)
        await group.commit(coord, 20)
        group.die("w1")
        await until(lambda: coord.job.state == JobState.PAUSED, "PAUSED")
        assert "w1" in coord.book.retired
        await coord.request_stop()
        stop_plan = group.current("w0").plan
        assert stop_plan.members == ("w0", "w2") and stop_plan.stop_step == 0, stop_plan
        assert await ended(coord) == JobState.STOPPED
        assert coord.journal.step == 20
        assert (tmp_path / "model.pt").exists() and list((tmp_path / "checkpoints").glob("step-00000020-*.pt"))
    run(scenario())


def test_a_death_while_stopping_keeps_the_stop(tmp_path):
    """A stop names step 21; before it commits, w2 dies. The survivors' re-formed plan must still carry
    the stop step, or they would train on until the coordinator's force-stop timer killed them."""
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("stopping", comm={"timeout_s": 30}), tmp_path, group)
        await group.commit(coord, 20)
        await coord.request_stop()
        assert coord.job.state == JobState.STOPPING and coord.book.plan.stop_step == 21
        group.die("w2")
        await until(lambda: coord.book.plan.members == ("w0", "w1"), "the survivors' plan")
        assert group.current("w0").plan.stop_step == 21, "the re-formed plan lost the stop"
        await group.commit(coord, 5)
        assert await ended(coord) == JobState.STOPPED
        assert coord.journal.step == 21
        assert not [e for e in events(coord) if "did not stop" in e.reason]
    run(scenario())


def test_a_stop_whose_members_never_reach_the_stop_step_kills_their_processes_before_it_ends(tmp_path, monkeypatch):
    """Every member is stuck in its step after the stop (nothing commits): past `comm.timeout_s` plus
    the grace, the coordinator SIGKILLs the processes of the live members itself (those on its node die
    at once; Ray's kill alone reaches a process later), then ends the job STOPPED."""
    import actors.control.lifecycle as lifecycle_module

    monkeypatch.setattr(lifecycle_module, "FORCE_STOP_AFTER_S", 0.05)

    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("stalled", comm={"timeout_s": 0.2}), tmp_path, group)
        await group.commit(coord, 5)
        members = {(m.node, m.pid) for m in coord.book.members.values()}
        await coord.request_stop()  # and no member commits again
        assert await ended(coord) == JobState.STOPPED
        assert [e for e in events(coord) if "did not stop" in e.reason]
        assert len(members) == 3 and set(group.processes_killed) == members, group.processes_killed
    run(scenario())


def test_a_replacement_adopts_a_ready_hot_spare_and_a_new_spare_starts_behind_it(tmp_path):
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("spares", workers={"spares": 1}), tmp_path, group)
        spare = await until(lambda: next((s for s in coord.spares.spares if s.ready), None), "a ready spare")
        saved = json.loads((tmp_path / "coordinator.json").read_text())
        assert saved["spares"] == [spare.name], "a spare's name is in the state file before it is used"
        await group.commit(coord, 3)
        group.die("w1")
        await until(lambda: coord.book.plan.members == ("w0", "w2"), "the survivors' plan")
        await group.commit(coord, 1)
        await until(lambda: "w1" in coord.book.plan.members, "the replacement")
        assert coord.book.members["w1"].handle is spare.handle, "w1 is the spare's actor"
        assert group.current("w1").name == spare.name
        assert any(e.reason.startswith("w1 is hot spare") for e in events(coord, "info"))
        await group.commit(coord, 1)  # settled: the spare behind it starts
        behind = await until(lambda: next((s for s in coord.spares.spares if s.ready), None), "a spare behind it")
        assert behind.name != spare.name
        await stopped(coord, group, 2)
        assert not coord.spares.spares and not behind.handle.alive, "the job's end kills its spares"
    run(scenario())


def test_a_slot_that_always_fails_to_start_is_retired_and_the_job_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr("actors.control.launcher.RESTART_AFTER_S", 0.01)
    async def scenario():
        group = FakeWorkerGroup()
        group.start_failures["w2"] = "ValueError: this workload always fails in slot w2"
        coord = coordinator(config("budget", workers={"min": 2, "failure_budget": 2}), tmp_path, group)
        await coord.start()
        await until(lambda: coord.job.state == JobState.RUNNING, "RUNNING on the others")
        retired = await until(lambda: events(coord, "retired"), "w2 retired")
        assert retired[0].detail == {"slot": "w2", "failures": 2}
        assert coord.book.members["w2"].state.value == "retired"
        assert "failure_budget = 2" in coord.book.members["w2"].cause
        assert coord.book.plan.members == ("w0", "w1")
        assert len([w for w in group.workers.values() if w.slot == "w2"]) == 2, "started twice, then no more"
        await group.commit(coord, 5)
        await stopped(coord, group, 1)
    run(scenario())


def test_a_member_that_stops_answering_heartbeats_is_evicted(tmp_path):
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("hang", workers={"heartbeat_s": 0.2}), tmp_path, group)
        await group.commit(coord, 2)
        group.hang("w0")
        failure = await until(lambda: events(coord, "failure"), "the eviction")
        assert failure[0].detail["detector"] == "heartbeat" and failure[0].detail["slot"] == "w0"
        await until(lambda: coord.book.plan.members[:2] == ("w1", "w2"), "the survivors' plan")
        await stopped(coord, group, 3)
    run(scenario())


def test_below_min_with_no_resources_is_paused_and_resumes_when_placed(tmp_path):
    async def scenario():
        group = FakeWorkerGroup()
        group.unplaced = True
        coord = coordinator(config("room", workers={"min": 2}), tmp_path, group)
        await coord.start()
        await until(lambda: coord.job.state == JobState.PAUSED, "PAUSED for resources")
        assert "cannot be placed" in coord.job.cause
        group.place()
        await until(lambda: coord.job.state == JobState.RUNNING, "RUNNING once placed")
        await stopped(coord, group, 2)
    run(scenario())


def test_workers_placed_but_slow_to_start_keep_the_job_starting_never_paused(tmp_path):
    """PAUSED is for workers Ray cannot place. Placed workers whose start takes 2 s (imports, data; ten
    times `pause_after_s`) keep the job STARTING, with the cause saying they are placed, until they are
    up: the job never passes through PAUSED (a negative that load cannot make true by chance: the
    start lasts at least its 2 s)."""
    async def scenario():
        group = FakeWorkerGroup()
        group.ready_delay_s = 2.0
        coord = coordinator(config("slow-start", workers={"count": 2, "pause_after_s": 0.2}), tmp_path, group)
        await coord.start()
        causes: list = []

        def running() -> bool:
            causes.append(coord.job.cause)
            return coord.job.state == JobState.RUNNING
        await until(running, "RUNNING once the workers are up")
        transitions = [(e.state_from, e.state_to) for e in events(coord, "transition")]
        assert ("STARTING", "PAUSED") not in transitions, transitions
        assert any(c and "placed" in c for c in causes), causes
        await stopped(coord, group, 2)
    run(scenario())


def test_scale_up_and_down(tmp_path):
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("scale", workers={"count": 2, "max": 4}), tmp_path, group)
        await group.commit(coord, 2)
        await coord.scale(4)
        await until(lambda: len(coord.book.plan.members) == 4, "the join")
        await group.commit(coord, 1)
        await coord.scale(2)
        assert coord.book.plan.members == ("w0", "w1")
        await until(lambda: not group.current("w3").alive or group.current("w3").ended.done(), "w3 told to leave")
        with pytest.raises(ValueError, match="outside"):
            await coord.scale(9)
        await stopped(coord, group, 2)
    run(scenario())


def member_status(status: dict, slot: str) -> dict:
    return next(m for m in status["members"] if m["slot"] == slot)


def test_a_scale_made_before_the_spare_is_ready_takes_the_spare_as_soon_as_it_is_ready(tmp_path):
    """The hang of a first hour, in process: count 2, max 3, one hot spare still starting, and no room for
    a new actor (the cluster holds `max` workers and the spare). w2 waits for the spare (its status says
    so), starts no new actor, and takes the spare once it is ready; `scale` returns once the plan of 3
    is out. Before, w2 asked for a new actor that could not be placed, and the spare, once ready, was
    never given to it."""
    async def scenario():
        group = FakeWorkerGroup()
        group.hold("early/r1/spare1")  # placed, its start (imports, the workload) not done until released
        coord = await started(config("early", workers={"count": 2, "max": 3, "spares": 1, "pause_after_s": 30.0}),
                              tmp_path, group)
        spare = await until(lambda: next((s for s in coord.spares.spares if s.handle is not None), None), "the spare")
        group.unplaced = True  # no room for another actor
        await group.commit(coord, 5)
        scaling = asyncio.ensure_future(coord.scale(3))
        w2 = await until(lambda: coord.book.members.get("w2"), "w2 started")
        await until(lambda: w2.waiting_for, "w2 waiting for the spare")
        assert not scaling.done() and not spare.ready
        assert "early/r1/w2" not in {w.name for w in group.workers.values()}, "no new actor while a spare is on its way"
        assert "waiting for a hot spare" in member_status(await coord.status(), "w2")["cause"]
        group.release("early/r1/spare1")
        status = await scaling
        assert status["world_size"] == 3 and coord.book.plan.members == ("w0", "w1", "w2"), status
        assert w2.handle is spare.handle and not member_status(status, "w2")["cause"]
        await stopped(coord, group, 2)
    run(scenario())


def test_a_joiner_and_a_spare_that_cannot_be_placed_are_said_and_the_joiner_takes_the_spare_once_ready(tmp_path):
    """No room at all: the spare cannot be placed, then neither can w2's new actor. Each is an event naming
    what it needs and what the cluster has free, w2's cause in `status` says it, and `scale` returns
    (world size 2) instead of waiting for ever. Once the spare is placed and ready, w2 takes it and its
    new actor is killed: a slot never waits on an actor Ray cannot place while a spare sits ready."""
    async def scenario():
        group = FakeWorkerGroup()
        group.no_room_for("full/r1/spare1")
        coord = await started(config("full", workers={"count": 2, "max": 3, "spares": 1}), tmp_path, group)
        group.unplaced, group.free = True, {"CPU": 0.0}
        said = await until(lambda: events(coord, "unplaced"), "the spare's event")
        assert said[0].reason.startswith("hot spare spare1 cannot be placed after 0.2s: it needs 0.5 CPUs, the cluster "
                                         "has 0 CPUs free"), said[0].reason
        await group.commit(coord, 3)
        status = await coord.scale(3)  # once w2 too waits for room the cluster has not got
        assert status["world_size"] == 2, status
        assert member_status(status, "w2")["state"] == "starting"
        assert member_status(status, "w2")["cause"] == "cannot be placed: it needs 0.5 CPUs, the cluster has 0 CPUs free"
        assert [e.detail.get("slot") for e in events(coord, "unplaced")][:2] == [None, "w2"]
        fresh = group.current("w2")
        assert fresh.name == "full/r1/w2"
        group.place("full/r1/spare1")
        await until(lambda: coord.book.plan.members == ("w0", "w1", "w2"), "w2 joining on the spare")
        assert coord.book.members["w2"].handle.name == "full/r1/spare1" and not fresh.alive, "its new actor is killed"
        assert not member_status(await coord.status(), "w2")["cause"]
        await stopped(coord, group, 2)
    run(scenario())


def test_a_scale_down_while_a_joiner_starts_drops_the_joiner_first(tmp_path):
    """w2 cannot be placed; a scale to 1 then drops it (killed, `left`, never admitted) and w1 leaves by a
    plan. Before, that scale was taken and nothing happened: no member left while a joiner was starting,
    and the joiner was admitted once placed, over the target."""
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("drop", workers={"count": 2, "max": 3}), tmp_path, group)
        group.unplaced, group.free = True, {"CPU": 0.0}
        await coord.scale(3)
        fresh = group.current("w2")
        await coord.scale(1)
        assert coord.book.plan.members == ("w0",) and coord.book.members["w2"].state.value == "left"
        assert not fresh.alive and "no longer wanted" in coord.book.members["w2"].cause
        group.place()
        await group.commit(coord, 3)
        assert coord.book.plan.members == ("w0",), "the dropped joiner is never admitted"
        await stopped(coord, group, 2)
    run(scenario())


def test_a_scale_that_no_free_slot_can_serve_is_refused_with_the_reason(tmp_path, monkeypatch):
    """w2's start always fails and its slot is retired; a scale to 3 then has no slot to start: refused,
    naming the retired slot, instead of taken and left undone."""
    monkeypatch.setattr("actors.control.launcher.RESTART_AFTER_S", 0.01)
    async def scenario():
        group = FakeWorkerGroup()
        group.start_failures["w2"] = "ValueError: this workload always fails in slot w2"
        coord = await started(config("no-slot", workers={"count": 2, "max": 3, "failure_budget": 1}), tmp_path, group)
        status = await coord.scale(3)  # once w2 is retired: nothing is coming any more
        assert status["world_size"] == 2 and "w2" in coord.book.retired
        with pytest.raises(ValueError, match="no free slot for 1 more worker.*w2 were retired"):
            await coord.scale(3)
        await stopped(coord, group, 2)
    run(scenario())


def test_a_scale_fault_scales_the_job_once_its_step_is_committed_and_only_once(tmp_path):
    """`faults.scale`: the order of a scale and the job's steps is written in the config. The job grows
    to 4 once step 3 is committed, shrinks to 2 once step 6 is, and neither entry fires again."""
    async def scenario():
        group = FakeWorkerGroup()
        cfg = config("scale-fault", workers={"count": 2, "max": 4},
                     faults={"scale": [{"step": 3, "count": 4}, {"step": 6, "count": 2}]})
        coord = await started(cfg, tmp_path, group)
        await group.commit(coord, 2)
        assert len(coord.book.plan.members) == 2, "not before step 3"
        await group.commit(coord, 1)
        await until(lambda: len(coord.book.plan.members) == 4, "the scale-up at step 3")
        await group.commit(coord, 3)
        await until(lambda: coord.book.plan.members == ("w0", "w1"), "the scale-down at step 6")
        await group.commit(coord, 4)
        assert coord.book.plan.members == ("w0", "w1") and coord.book.target_count == 2
        fired = [e.reason for e in events(coord, "fault")]
        assert len(fired) == 2 and "scale to 4" in fired[0] and "scale to 2" in fired[1], fired
        assert sorted(json.loads((tmp_path / "coordinator_faults_fired.json").read_text())) == ["scale-0", "scale-1"]
        await stopped(coord, group, 2)
    run(scenario())


def test_members_that_die_together_abort_the_epoch_once_and_re_form_once(tmp_path, monkeypatch):
    """Deaths that come within QUIET_S of each other (for at most GATHER_MAX_S) are one re-form: 10 and 100 ms
    in the product, 0.5 and 5 s here, so that three deaths 3 ms apart stay one batch however late this
    loop runs them."""
    monkeypatch.setattr("actors.control.outcomes.QUIET_S", 0.5)
    monkeypatch.setattr("actors.control.outcomes.GATHER_MAX_S", 5.0)

    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("storm", workers={"count": 8, "min": 2}), tmp_path, group)
        await group.commit(coord, 3)
        epoch = coord.book.epoch
        for slot in ("w1", "w4", "w6"):
            group.die(slot)
            await asyncio.sleep(0.003)
        await until(lambda: coord.book.plan.members == ("w0", "w2", "w3", "w5", "w7"), "the survivors' plan")
        assert coord.book.epoch == epoch + 1, "one re-form for the three deaths"
        assert group.current("w0").aborted == [epoch], "the epoch aborted once"
        assert len([e for e in events(coord, "failure")]) == 3
        await stopped(coord, group, 2)
    run(scenario())


def test_a_restarted_coordinator_reattaches_the_live_members_and_history_has_no_gap(tmp_path):
    """The coordinator's process dies at step 5 (rank 0 reported up to there), just after publishing a
    plan it never saved; the members train on to step 8 alone and w2 dies meanwhile. The next incarnation carries on from the run
    directory: it
    re-attaches w0 and w1, takes steps 6..8 from what they kept, publishes an epoch newer than any
    they hold, and replaces w2."""
    async def scenario():
        group = FakeWorkerGroup()
        first = await started(config("restart"), tmp_path, group)
        await group.commit(first, 5)
        epoch = first.book.epoch
        # its state file holds what it had at step 5 (its writer thread, not the cancelled task, writes it;
        # under load a write could still be on its way when the next incarnation reads the file)
        assert await asyncio.to_thread(first.journal.wait_saved, first.state_file.save(), 10)
        first.lifecycle.release()
        first.lifecycle.main_task.cancel()  # the process is gone: nothing more reaches the workers from it
        await asyncio.sleep(0.05)
        for step in (6, 7, 8):  # committed while no coordinator listened
            for slot in ("w0", "w1", "w2"):
                worker = group.current(slot)
                worker.step = step
                worker.kept.append({"step": step, "time": time.time(), "loss": 0.1, "world_size": 3, "global_batch": 24,
                                    "micro_steps": 1, "membership_epoch": epoch})
        unsaved = dataclasses.replace(first.book.plan, version=first.book.version + 1, membership_epoch=epoch + 1)
        for slot in ("w0", "w1"):  # a plan published just before the crash, never saved
            group.current(slot).plans.append(unsaved)
        group.die("w2")
        group.reconstructed = True
        second = coordinator(config("restart"), tmp_path, group)
        assert second.run.incarnation == 1 and second.job.state == JobState.RESHAPING
        await second.start()  # Ray's restart calls it (start_self_when_alive)
        await until(lambda: second.book.live() == ("w0", "w1", "w2") and second.book.members["w2"].incarnation > 3,
                    "the re-attached members and w2's replacement")
        restart = events(second, "restart")[0]
        assert restart.detail["reattached"] == ["w0", "w1"] and restart.detail["lost"] == ["w2"]
        assert second.book.epoch > epoch + 1, "an epoch newer than any a member holds (the unsaved plan's included)"
        assert second.book.version > unsaved.version
        await group.commit(second, 2)
        await stopped(second, group, 2)
        steps = [json.loads(line)["step"] for line in (tmp_path / "history.jsonl").read_text().splitlines()]
        assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= 10, steps
    run(scenario())


def test_the_metrics_follow_history_and_count_one_recovery_per_death(tmp_path):
    """What the coordinator exports (actors/observe/metrics.py) against what history and events say: committed
    steps and samples, world size back to its count, one departure and one recovery time per death,
    one join, bytes as the records' differences, the state gauge."""
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("metrics"), tmp_path, group)
        await death_and_replacement(coord, group, 4, 2)
        await group.commit(coord, 3)
        await until(lambda: coord.job.state == JobState.RUNNING, "RUNNING again")
        m = {name: metric.values for name, metric in group.metrics.items()}
        assert m["state"][(("state", "RUNNING"),)] == 1 and m["state"][(("state", "RESHAPING"),)] == 0
        await stopped(coord, group, 2)
        history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
        assert [r["step"] for r in history] == list(range(1, len(history) + 1))
        assert m["committed_steps"][()] == len(history)
        assert m["samples"][()] == sum(r["global_batch"] for r in history)
        assert m["world_size"][()] == 3 and m["membership_epoch"][()] == history[-1]["membership_epoch"]
        assert m["departures"] == {(("detector", "actor death"),): 1}
        assert list(m["recovery_seconds"]) == [(("detector", "actor death"),)]
        deaths = [e for e in events(coord, "reshape") if e.detail["detector"] == "actor death"]
        assert m["recovery_seconds"][(("detector", "actor death"),)] == [deaths[0].detail["duration_s"]]
        assert len(m["join_seconds"][()]) == 1 and m["joins"] == {(("detector", "replacement"),): 1}
        assert m["bytes"][(("kind", "gradients"),)] == 1000 * (len(history) - 1), "each record's bytes over the one before"
        assert m["state"][(("state", "STOPPED"),)] == 1
    run(scenario())


def test_a_long_poll_on_the_feed_is_answered_by_the_change_it_waits_for(tmp_path):
    """`watch_feed` (what `ElasticJob.wait_for` asks) answers when an event numbered past what the
    caller has seen is recorded, or when the job's step passes the one named: each wait below allows
    the feed 600 s of its own, so only the wake-up can answer it within the test's 10 s; with the
    feed's wake-up switched off, the waits time out here. Event numbers are lines of events.jsonl."""
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("feed"), tmp_path, group)
        await group.commit(coord, 2)
        seen = coord.journal.count
        lines = (tmp_path / "events.jsonl").read_text().splitlines()
        assert seen == len(lines) and coord.journal.since(0)[0] == [json.loads(line) for line in lines]
        poll = asyncio.ensure_future(coord.watch_feed(seen, 2**62, 600))
        await asyncio.sleep(0)
        group.die("w1")
        answer = await asyncio.wait_for(poll, 10)
        assert answer["complete"] and answer["count"] > seen and answer["events"], answer
        assert answer["events"][0] == json.loads((tmp_path / "events.jsonl").read_text().splitlines()[seen])
        await until(lambda: coord.book.plan.members == ("w0", "w2"), "the survivors' plan")
        step = coord.journal.step
        poll = asyncio.ensure_future(coord.watch_feed(coord.journal.count, step + 2, 600))
        await asyncio.sleep(0)
        await group.commit(coord, 4)
        answer = await asyncio.wait_for(poll, 10)
        assert answer["step"] > step + 2, answer
        await stopped(coord, group)
        answer = await asyncio.wait_for(coord.watch_feed(coord.journal.count, 2**62, 600), 10)
        assert answer["state"] == "STOPPED", "an ended job answers at once"
    run(scenario())


def test_the_feed_numbers_events_by_their_line_across_a_restart(tmp_path):
    """A restarted coordinator counts the events the run recorded before it (its journal re-reads them),
    so a number a driver holds still names the same line."""
    from actors.control.journal import Journal

    first = Journal(tmp_path, keep_checkpoints=1)
    for i in range(5):
        first.event("info", f"event {i}")
    first.close()
    (tmp_path / "coordinator.json").write_text(json.dumps({"loss": None, "metrics": {}}))
    again = Journal(tmp_path, keep_checkpoints=1)
    again.load_state()
    again.event("info", "after the restart")
    events, complete = again.since(4)
    assert again.count == 6 and complete and [e["reason"] for e in events] == ["event 4", "after the restart"]
    again.close()


def test_a_jobs_elapsed_time_is_the_coordinators_span_not_the_time_until_wait(tmp_path):
    """`JobResult.elapsed_s` runs from `start()` (the driver hands its time to the coordinator) to the
    job's end as the coordinator recorded it: a `wait()` called long after the end does not count."""
    from orchestrator.job import ElasticJob

    cfg = config("elapsed", stop={"max_steps": 3})
    started_at = time.time() - 100.0  # start() was called 100 s ago

    async def scenario():
        group = FakeWorkerGroup()
        coord = Coordinator(cfg, "r1", str(tmp_path), group=group, started_at=started_at)
        RUNNING_NOW.append(coord)
        await coord.start()
        await until(lambda: coord.job.state == JobState.RUNNING, "RUNNING")
        await group.commit(coord, 5)
        assert await ended(coord) == JobState.FINISHED
    run(scenario())
    status = json.loads((tmp_path / "status.json").read_text())
    job = ElasticJob(config_from_dict(cfg))
    job.run_dir, job.run_id = tmp_path, "r1"  # the coordinator is gone: wait() reads its final status
    result = job.wait(timeout=10)
    assert status["started_at"] == started_at and status["ended_at"] < time.time()
    assert result.elapsed_s == status["ended_at"] - status["started_at"]


def test_a_restart_takes_an_incarnation_above_every_one_the_store_has_seen(tmp_path):
    """Incarnation 1 claimed the run on the store while incarnation 0, cut off by a partition, went on
    and uploaded its older state file last; then 1's node is lost too. The restart on a third node
    hydrates 0's state file, and must still not come back as incarnation 1 (its group names would be 1's)."""
    import shutil
    import uuid

    from actors.runs.storage import open_storage

    uri = f"memory://bucket-{uuid.uuid4().hex[:8]}/runs"
    run_dir = tmp_path / "fenced" / "r1"

    async def scenario():
        group = FakeWorkerGroup()
        first = await started(config("fenced", storage=uri), run_dir, group)
        await group.commit(first, 3)
        first.lifecycle.release()
        first.lifecycle.main_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first.lifecycle.main_task  # the incarnation has stopped: nothing of it writes while its node goes
        first.journal.close()  # its last state file on disk and in the store (it raced the rmtree below)
        storage = open_storage(uri)
        assert json.loads(storage.read("fenced/r1/coordinator.json"))["incarnation"] == 0
        storage.write("fenced/r1/incarnations/0000000001-0123456789ab", b"{}")  # 1's claim (docs/storage.md)
        shutil.rmtree(run_dir)  # a new node
        group.reconstructed = True
        second = coordinator(config("fenced", storage=uri), run_dir, group)
        assert second.run.incarnation == 2, f"the restart took incarnation {second.run.incarnation}, which the store had seen"
        second.journal.mirror.close(10)
    run(scenario())


def test_a_restart_from_a_lagging_state_file_never_reuses_a_worker_incarnation(tmp_path):
    """The state file a restart reads can lag the dead incarnation (the store's copy is one upload
    behind): its count of worker starts is stale. A replacement must still not take a worker incarnation
    number the dead one gave (the parameter server and the dispenser fence a slot by it)."""
    async def scenario():
        group = FakeWorkerGroup()
        first = await started(config("lagging"), tmp_path, group)
        await group.commit(first, 3)
        given = max(m.incarnation for m in first.book.members.values())
        first.lifecycle.release()
        first.lifecycle.main_task.cancel()
        await asyncio.sleep(0.05)
        saved = json.loads((tmp_path / "coordinator.json").read_text())
        saved["started_workers"] = 1  # written before the other starts
        (tmp_path / "coordinator.json").write_text(json.dumps(saved))
        group.die("w2")
        group.reconstructed = True
        second = coordinator(config("lagging"), tmp_path, group)
        await second.start()
        await until(lambda: second.book.live() == ("w0", "w1", "w2") and second.book.members["w2"].handle is not None
                    and second.book.members["w2"].state.name == "TRAINING", "w2 replaced")
        assert second.book.members["w2"].incarnation > given, (second.book.members["w2"].incarnation, given)
        await group.commit(second, 1)
        await stopped(second, group, 1)
    run(scenario())
