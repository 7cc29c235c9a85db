"""The membership book (actors/control/book.py): plans, epochs, reshapes, slots. Pure: no Ray, no loop."""
from __future__ import annotations

from actors.control.book import ADMIT_HOLD_S, Convergence, MembershipBook
from actors.control.members import Member
from algorithms.rules.kinds import BACKGROUND, DECENTRALIZED, SYNCHRONOUS
from algorithms.rules.supervision import JobState, MemberState
from core.schema import JobConfig, parse
from orchestrator.config import config_from_dict

S = MemberState


def book(policy: str = "bsp", **workers) -> MembershipBook:
    cfg = config_from_dict({"name": "b", "workers": {"count": 3, "max": 5, **workers},
                            "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8},
                            "sync": {"policy": policy}, "stop": {"max_steps": 10}})
    b = MembershipBook(parse(JobConfig, cfg.to_dict()), "r", DECENTRALIZED if policy == "dpsgd" else SYNCHRONOUS)
    for i in range(3):
        b.members[f"w{i}"] = Member(f"w{i}", None, state=S.TRAINING, incarnation=i + 1)
    return b


def plan(b: MembershipBook, members, **kw):
    return b.next_plan(tuple(members), "why", incarnation=0, store_host="h", store_port=1, history_step=0, **kw)


def test_a_new_epoch_when_the_members_change_or_when_asked_and_always_for_gossip():
    b = book()
    assert plan(b, ["w0", "w1", "w2"]).membership_epoch == 1
    same = plan(b, ["w0", "w1", "w2"])
    assert (same.version, same.membership_epoch) == (2, 1), "a stop plan for the same members keeps the epoch"
    assert plan(b, ["w0", "w2"]).membership_epoch == 2
    assert plan(b, ["w0", "w2"], new_epoch=True).membership_epoch == 3
    g = book("dpsgd")
    plan(g, ["w0", "w1"])
    assert plan(g, ["w0", "w1"]).membership_epoch == 2, "gossip members cannot switch plans together at a step"


def test_the_stop_step_rides_on_every_plan_and_the_group_is_named_by_epoch():
    b = book()
    b.stop_step = 21
    p = plan(b, ["w0", "w1"])
    assert p.stop_step == 21 and p.group_name == "b/r/c0/e1"
    assert p.global_batch == 24 and p.lr_scale == 1.0, "keep_global: the initial world's global batch"


def test_a_reshape_closes_at_the_first_commit_of_its_epoch_and_its_joiners_then_hold_the_state():
    b = book()
    plan(b, ["w0", "w1", "w2"])
    b.members["w3"] = Member("w3", None, state=S.TRAINING, holds_state=False)
    p = plan(b, ["w0", "w1", "w2", "w3"])
    b.open_reshape(p, ("w0", "w1", "w2"), "scale", "scale request", 100.0, joiners=("w3",))
    assert b.close_reshapes({"step": 5, "time": 101.5, "membership_epoch": 1}) == [], "an older epoch's commit"
    (closed,) = b.close_reshapes({"step": 6, "time": 102.0, "membership_epoch": 2})
    assert closed["duration_s"] == 2.0 and closed["cause"] == "scale" and closed["first_committed_step"] == 6
    assert b.members["w3"].holds_state and not b.pending


def test_joiners_are_held_for_the_survivors_first_commit_at_most_the_hold():
    b = book()
    plan(b, ["w0", "w1", "w2"])
    p = plan(b, ["w0", "w1"])
    b.members["w2"].state = S.DEAD
    b.open_reshape(p, ("w0", "w1", "w2"), "death", "actor death", 100.0)
    assert b.held_departure(JobState.RESHAPING, now=100.0 + ADMIT_HOLD_S / 2)
    assert not b.held_departure(JobState.RESHAPING, now=100.0 + ADMIT_HOLD_S), "never longer than the hold"
    assert not b.held_departure(JobState.PAUSED, now=100.1), "nobody commits while PAUSED"
    b.close_reshapes({"step": 3, "time": 100.2, "membership_epoch": p.membership_epoch})
    assert not b.held_departure(JobState.RUNNING, now=100.3)


def test_a_slot_is_retired_at_its_budget_and_never_offered_again():
    b = book(failure_budget=2)
    assert not b.count_failure("w1", "boom")
    assert b.count_failure("w1", "boom again")
    assert "failure_budget = 2" in b.retired["w1"] and "boom again" in b.retired["w1"]
    plan(b, ["w0", "w2"])
    b.members["w1"].state = S.RETIRED
    assert b.converge() == Convergence(1, start=("w3",)), "the lowest free slot that is not retired"


def test_converge_drops_the_newest_members_when_over_the_target():
    b = book()
    plan(b, ["w0", "w1", "w2"])
    b.target_count = 2
    assert b.converge() == Convergence(0, leave=("w2",))
    b.target_count = 3
    assert b.converge() == Convergence(0)


def test_a_scale_down_drops_the_joiners_not_yet_admitted_first():
    """A scale to 1 while w3 and w4 are still starting (a scale to 5 under way): both joiners are dropped
    (nobody waits for them) and w2 then w1 leave. Before, the scale was taken and nothing happened: no
    member left while a joiner was starting, and the joiners were admitted later, over the target."""
    b = book()
    plan(b, ["w0", "w1", "w2"])
    b.members["w3"] = Member("w3", None)
    b.members["w4"] = Member("w4", None, state=S.READY)
    b.target_count = 4
    assert b.converge() == Convergence(0, drop=("w4",)), "the newest joiner first"
    b.target_count = 1
    assert b.converge() == Convergence(0, drop=("w4", "w3"), leave=("w2", "w1"))


def test_the_state_file_round_trips_and_the_dispenser_keeps_leavers_until_they_leave():
    b = book()
    plan(b, ["w0", "w1", "w2"])
    b.members["w2"].state = S.LEAVING
    plan(b, ["w0", "w1"])
    assert b.server_membership() == [("w0", 1), ("w1", 2)], "a server kind admits the plan's members only"
    b.kind = BACKGROUND
    assert b.server_membership() == [("w0", 1), ("w1", 2), ("w2", 3)], "the dispenser keeps a leaver until it leaves"
    b.failures, b.retired, b.stop_step = {"w1": 1}, {"w4": "gone"}, 9
    b.depart(b.members["w2"])
    again = book()
    again.load(__import__("json").loads(__import__("json").dumps(b.snapshot())))
    assert (again.plan, again.epoch, again.version) == (b.plan, b.epoch, b.version)
    assert (again.failures, again.retired, again.stop_step, again.departed) == (b.failures, b.retired, 9, b.departed)


def test_plans_name_lab_nodes_only_for_an_emulated_network_and_ray_nodes_for_a_told_one():
    """Hierarchical all-reduce groups by `Plan.nodes`: the lab's virtual nodes when the lab emulates the
    network; a told real cluster's network (`emulate: false`) is only the planner's, so the members'
    own Ray nodes there."""
    def with_network(emulate: bool) -> MembershipBook:
        cfg = config_from_dict({"name": "b", "workers": {"count": 2},
                                "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8},
                                "network": {"nodes": 2, "emulate": emulate}, "stop": {"max_steps": 10}})
        b = MembershipBook(parse(JobConfig, cfg.to_dict()), "r", SYNCHRONOUS)
        for i in range(2):
            b.members[f"w{i}"] = Member(f"w{i}", None, state=S.TRAINING, incarnation=i + 1, node_id=f"ray-node-{i}")
        return b

    assert plan(with_network(True), ["w0", "w1"]).nodes == ("lab0", "lab1")
    assert plan(with_network(False), ["w0", "w1"]).nodes == ("ray-node-0", "ray-node-1")
