"""`sync.auto`'s online trial wired into the real coordinator (actors/control/plans.py), over the fake worker
group (no Ray): the committed records rank 0 reports reach the trial, which switches the live members to the
next candidate by a plan of a new membership epoch that carries the policy (no joiner, no leaver: the same
worker processes), and once every candidate had its turn records its measured step times and the pick. The
trial's decisions alone: tests/unit/test_trial.py; the replicas' switch, exact: tests/unit/test_policy_switch.py."""
from __future__ import annotations

import time

from actors.control.coordinator import Coordinator
from actors.plan import Progress
from testkit.fake_workers import FakeWorkerGroup
from testkit.job_checks import until
from tests.unit.test_coordinator_paths import config, events, run, started, stopped

CANDIDATES = [
    {"label": "bsp", "sync": {"policy": "bsp"}, "compression": {"codec": "none"}, "step_s": 0.010, "factor": 1.0},
    {"label": "bsp hierarchical", "sync": {"policy": "bsp", "hierarchical": True}, "compression": {"codec": "none"},
     "step_s": 0.008, "factor": 1.0}]


async def commit(coord: Coordinator, group: FakeWorkerGroup, steps: int, step_s: float, clock: list[float]) -> None:
    """`steps` committed steps of `step_s` each (a virtual clock) under the plan's policy, reported as rank 0
    reports them: each record labelled with the policy the plan carries (none: the config's own)."""
    plan = coord.book.plan
    assert plan is not None
    members = [group.current(s) for s in plan.members]
    for _ in range(steps):
        step = max(w.step for w in members) + 1
        for worker in members:
            worker.step = step
        clock[0] += step_s
        record = {"step": step, "time": clock[0], "loss": 1.0 / step, "world_size": len(members),
                  "global_batch": plan.global_batch, "micro_steps": 1, "membership_epoch": plan.membership_epoch,
                  "bytes_sent": 1000 * step}
        if plan.policy is not None:
            record["policy"] = plan.policy["label"]
        await coord.report(Progress(members[0].slot, step, plan.membership_epoch, time.time(), (record,), step_s,
                                    mark=step))


def test_the_trial_switches_the_live_members_by_a_plan_and_records_its_measurements_and_pick(tmp_path):
    """Each candidate runs 6 steps: bsp at 10 ms a step, then bsp hierarchical at 8 ms; the switch is a plan of
    the same members in a new epoch carrying the candidate (fresh until its first step commits), and the trial's
    event names both measurements and picks the faster. With the records kept from the trial (the
    coordinator's offer switched off), no switch comes and the test fails on its wait."""
    cfg = config("trial", workers={"count": 2})
    cfg["policy_trial"] = {"steps": 6, "candidates": CANDIDATES}
    clock = [time.time()]

    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(cfg, tmp_path, group)
        first = coord.book.plan
        processes = {name for name in group.workers}
        await commit(coord, group, 8, 0.010, clock)
        switched = await until(lambda: (p := coord.book.plan).policy is not None and p, "the switch's plan")
        assert switched.policy["label"] == "bsp hierarchical" and switched.policy["fresh"], switched.policy
        assert switched.members == first.members and switched.membership_epoch > first.membership_epoch
        (switch,) = events(coord, "policy_switch")
        assert switch.detail["policy"] == "bsp hierarchical", switch
        await commit(coord, group, 8, 0.008, clock)
        (reshape,) = [e.detail for e in events(coord, "reshape")]  # recorded once the new epoch has committed
        assert reshape["detector"] == "policy trial" and not reshape["joiners"] and not reshape["leavers"], reshape
        (trial,) = await until(lambda: events(coord, "policy_trial"), "the trial's pick")
        measured = {c["label"]: round(c["measured_step_s"], 6) for c in trial.detail["candidates"]}
        assert measured == {"bsp": 0.010, "bsp hierarchical": 0.008}, trial.detail
        assert trial.detail["chosen"] == "bsp hierarchical"
        assert coord.book.policy["label"] == "bsp hierarchical" and not coord.book.policy["fresh"], "later plans: as is"
        assert {name for name in group.workers} == processes, "the same worker processes: no restart"
        await stopped(coord, group, 2)
    run(scenario())
