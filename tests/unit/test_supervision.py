"""The coordinator's decisions on deaths, finishes, stops and restarts, without Ray."""
from __future__ import annotations

from algorithms.rules.kinds import BACKGROUND, DECENTRALIZED, PERIODIC, SERVER, SYNCHRONOUS
from algorithms.rules.supervision import (
    Decision,
    JobState,
    JobView,
    MemberEnded,
    MemberState,
    StopRequested,
    decide,
    recovered_epoch,
)

T, R = MemberState.TRAINING, MemberState.READY


def view(state=JobState.RUNNING, plan=("w0", "w1", "w2"), members=None, **over) -> JobView:
    members = members or {s: T for s in plan}
    return JobView(state=state, plan_members=plan, members=members, **over)


def death(slot="w1", **over) -> MemberEnded:
    return MemberEnded(slot=slot, outcome=over.pop("outcome", "died"), cause=f"worker {slot} died", detector="actor death", **over)


def test_death_while_running_reshapes_without_waiting_and_replaces():
    d = decide(view(), death())
    assert d.abort and d.publish == ("w0", "w2") and d.replace and d.count_failure and not d.retire
    assert d.transition == JobState.RESHAPING and d.member == ("w1", MemberState.DEAD)


def test_death_while_reshaping_reshapes_again_in_the_same_state():
    d = decide(view(JobState.RESHAPING), death("w0"))
    assert d.publish == ("w1", "w2") and d.transition is None and d.replace


def test_death_below_min_pauses_and_replaces():
    d = decide(view(min_workers=3), death())
    assert d.transition == JobState.PAUSED and d.publish is None and d.replace and d.abort
    assert "below workers.min = 3" in d.reason


def test_death_while_paused_stays_paused():
    members = {"w0": T, "w1": MemberState.DEAD, "w2": T}
    d = decide(view(JobState.PAUSED, members=members, min_workers=3), death("w2"))
    assert d.transition == JobState.PAUSED and d.publish is None and d.member == ("w2", MemberState.DEAD)


def test_death_while_stopping_keeps_the_stop_and_needs_no_minimum():
    d = decide(view(JobState.STOPPING, min_workers=3, stop_kind="STOPPED"), death())
    assert d.publish == ("w0", "w2") and not d.replace and d.transition is None


def test_budget_exhausted_retires_the_slot():
    d = decide(view(failures={"w1": 2}, failure_budget=3), death())
    assert d.retire and d.count_failure and d.publish == ("w0", "w2")


def test_last_member_dead_fails_the_job():
    d = decide(view(plan=("w0",), members={"w0": T}), death("w0"))
    assert d.end_now == JobState.FAILED and "no live worker holds the committed state" in d.reason


def test_on_failure_fail_agrees_then_fails():
    d = decide(view(on_failure="fail"), death(outcome="error"))
    assert d.stop_kind == "FAILED" and d.stop_step == "held" and d.publish == ("w0", "w2")
    assert d.transition == JobState.STOPPING and d.member == ("w1", MemberState.FAILED) and not d.replace


def test_hung_member_is_recorded_as_hung():
    d = decide(view(), MemberEnded("w2", "died", cause="no heartbeat", detector="heartbeat", hung=True))
    assert d.member == ("w2", MemberState.HUNG)


def test_leaving_member_that_finishes_has_left():
    members = {"w0": T, "w1": T, "w2": MemberState.LEAVING}
    d = decide(view(plan=("w0", "w1"), members=members), MemberEnded("w2", "finished"))
    assert d.member == ("w2", MemberState.LEFT) and not d.finish


def test_leaving_member_that_dies_needs_no_reshape():
    members = {"w0": T, "w1": T, "w2": MemberState.LEAVING}
    d = decide(view(plan=("w0", "w1"), members=members), death("w2"))
    assert d.member == ("w2", MemberState.LEFT) and d.publish is None and not d.abort


def test_the_last_member_to_finish_ends_the_job():
    members = {"w0": MemberState.FINISHED, "w1": MemberState.FINISHED, "w2": T}
    assert decide(view(members=members), MemberEnded("w2", "finished")).finish
    assert not decide(view(), MemberEnded("w2", "finished")).finish


def test_a_member_lost_after_every_other_finished_ends_the_job_finished():
    """A server kind's others finish at the server's last version while one is stuck in a push: its
    eviction ends the job as finished (the model is the server's), not failed."""
    members = {"w0": MemberState.FINISHED, "w1": MemberState.FINISHED, "w2": T}
    d = decide(view(members=members), MemberEnded("w2", "died", "evicted", "step progress", hung=True))
    assert d.finish and d.member == ("w2", MemberState.HUNG) and d.end_now is None
    members["w1"] = T
    assert not decide(view(members=members), death()).finish


def test_an_outcome_of_a_departed_member_is_ignored():
    members = {"w0": T, "w1": MemberState.DEAD, "w2": T}
    assert decide(view(members=members), death()).ignore


def test_stop_while_running_stops_at_the_next_step():
    d = decide(view(), StopRequested("STOPPED", "stop requested"))
    assert d.publish == ("w0", "w1", "w2") and d.stop_step == "next" and d.transition == JobState.STOPPING


def test_stop_while_paused_republishes_the_survivors_at_their_held_step():
    members = {"w0": T, "w1": MemberState.DEAD, "w2": T}
    d = decide(view(JobState.PAUSED, members=members), StopRequested("STOPPED", "interrupted"))
    assert d.publish == ("w0", "w2") and d.stop_step == "held" and d.transition == JobState.STOPPING


def test_stop_with_no_training_member_ends_now():
    d = decide(view(JobState.PAUSED, plan=(), members={"w0": R}), StopRequested("STOPPED", "stop requested"))
    assert d.end_now == JobState.STOPPED and d.publish is None


def test_a_second_stop_is_ignored():
    assert decide(view(JobState.STOPPING, stop_kind="FINISHED"), StopRequested("STOPPED", "again")).ignore


def test_restart_publishes_an_epoch_no_worker_holds():
    assert recovered_epoch(saved_epoch=1, worker_epochs=[2, 2, 1]) == 3
    assert recovered_epoch(saved_epoch=4, worker_epochs=[]) == 5


def test_decisions_are_frozen_values():
    d = decide(view(), death())
    assert isinstance(d, Decision) and hash(d.publish)


# A joiner admitted to a running job holds no state until its epoch's entry gives it one.
F = MemberState.FINISHED


def test_the_last_holder_finishing_finishes_the_job_past_a_joiner_waiting_for_the_state():
    """The race seen in a bytegrad run: a replacement's plan [w2, w1] went out just as w0 and w2
    finished the last step, so it was never adopted; w1 must not be waited for (it would re-form
    alone and start over from its initial model)."""
    members = {"w0": F, "w2": T, "w1": T}
    d = decide(view(plan=("w2", "w1"), members=members, stateless=frozenset({"w1"})), MemberEnded("w2", "finished"))
    assert d.finish and d.member == ("w2", F)
    # a joiner that holds the state (it entered an epoch with the others) is still waited for
    assert not decide(view(plan=("w2", "w1"), members=members), MemberEnded("w2", "finished")).finish


def test_the_last_holder_dying_fails_the_job_rather_than_leave_it_to_joiners_without_state():
    members = {"w0": T, "w1": T}
    d = decide(view(plan=("w0", "w1"), members=members, stateless=frozenset({"w1"})), death("w0"))
    assert d.end_now == JobState.FAILED and d.publish is None and "no live worker holds the committed state" in d.reason


def test_a_holder_dying_after_the_others_finished_finishes_past_a_joiner_waiting_for_the_state():
    members = {"w0": F, "w2": T, "w1": T}
    d = decide(view(plan=("w2", "w1"), members=members, stateless=frozenset({"w1"})), death("w2"))
    assert d.finish and d.member == ("w2", MemberState.DEAD)


def test_a_joiner_waiting_for_the_state_stays_in_the_survivors_plan():
    """With a holder left, the joiner is published with it and loads the state at the new epoch."""
    d = decide(view(stateless=frozenset({"w2"})), death("w1"))
    assert d.publish == ("w0", "w2") and d.end_now is None and not d.finish


def test_the_last_holder_dying_while_a_shadow_joiner_waits_for_its_state_fails_the_job_as_for_bsp():
    """A joiner admitted after step 0 holds no state until a member sends it one, under every kind whose
    replicas are trained (a background joiner receives a live replica over its group). When the last
    member holding one dies meanwhile, the job fails (resumable), as BSP's does; it must not carry on
    with the joiner alone and end FINISHED with an untrained model."""
    from algorithms.rules.membership import joiners_start_stateless

    for kind in (SYNCHRONOUS, PERIODIC, DECENTRALIZED, BACKGROUND):
        stateless = frozenset({"w1"}) if joiners_start_stateless(kind, committed_step=10) else frozenset()
        d = decide(view(plan=("w0", "w1"), stateless=stateless), death("w0"))
        assert d.end_now == JobState.FAILED and d.publish is None, (kind, d)
    assert not joiners_start_stateless(BACKGROUND, committed_step=0), "before any step the initial model is the state"
    assert not joiners_start_stateless(SERVER, committed_step=10), "server kinds' members hold no state: the server does"


def test_the_last_holder_dying_restarts_from_the_newest_checkpoint_when_there_is_one():
    dead = {"w0": MemberState.DEAD, "w1": MemberState.DEAD, "w2": T}
    d = decide(view(members=dead, checkpoint_step=60), death("w2"))
    assert d.restore and d.replace and d.count_failure and d.end_now is None and d.publish is None, d
    assert d.transition == JobState.PAUSED and "checkpoint at step 60" in d.reason
    assert decide(view(members=dead), death("w2")).end_now == JobState.FAILED, "no checkpoint: fail, resumable"
    assert decide(view(members=dead, checkpoint_step=60, on_failure="fail"), death("w2")).end_now == JobState.FAILED
    assert not decide(view(members=dead, checkpoint_step=60), death("w1")).restore, "a dead member's second report"


def test_a_restarted_coordinator_publishes_past_the_servers_epoch_too():
    """The crashed incarnation told the parameter server epoch 2 (sent before the plan) but no worker got
    that plan and it was never saved: the server ignores a membership that is not newer than its own,
    so the restarted coordinator's next epoch must be past the server's as well."""
    assert recovered_epoch(saved_epoch=1, worker_epochs=[1, 1], server_epoch=2) == 3
    assert recovered_epoch(saved_epoch=1, worker_epochs=[1, 1]) == 2
