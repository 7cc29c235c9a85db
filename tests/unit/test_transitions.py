"""The job's and each member's transition tables (algorithms/rules/supervision.py): the one place each state
changes checks them (`JobStateMachine.transition`, `Member.move`), so an illegal move is refused, not made.
The whole coordinator runs under them in tests/unit/test_coordinator_paths.py."""
from __future__ import annotations

import pytest

from actors.control.members import Member
from algorithms.rules.supervision import (
    JOB_TRANSITIONS,
    MEMBER_TRANSITIONS,
    IllegalTransition,
    JobState,
    MemberState,
    check_transition,
)

J, M = JobState, MemberState


def test_every_state_has_a_row_and_may_stay_where_it_is():
    assert set(JOB_TRANSITIONS) == set(J) and set(MEMBER_TRANSITIONS) == set(M)
    assert all(s in JOB_TRANSITIONS[s] for s in J) and all(s in MEMBER_TRANSITIONS[s] for s in M)


@pytest.mark.parametrize("now,to", [(J.FINISHED, J.RUNNING), (J.FAILED, J.STOPPING), (J.STOPPED, J.FINISHED),
                                    (J.STOPPING, J.RUNNING), (J.STOPPING, J.PAUSED), (J.RUNNING, J.STARTING),
                                    (J.RESHAPING, J.STARTING)])
def test_a_job_never_leaves_an_end_a_stopping_job_only_ends_and_only_a_paused_start_starts_again(now, to):
    with pytest.raises(IllegalTransition, match=f"from {now.value} to {to.value}"):
        check_transition(JOB_TRANSITIONS, now, to, "job j")


@pytest.mark.parametrize("now,to", [(J.STARTING, J.RUNNING), (J.PAUSED, J.STARTING), (J.RUNNING, J.RESHAPING),
                                    (J.RESHAPING, J.RUNNING), (J.PAUSED, J.RUNNING), (J.RUNNING, J.STOPPING),
                                    (J.STOPPING, J.FINISHED), (J.RUNNING, J.FAILED), (J.STARTING, J.STOPPED)])
def test_the_jobs_own_moves_are_allowed(now, to):
    check_transition(JOB_TRANSITIONS, now, to, "job j")


def test_a_member_moves_forward_only_and_an_ended_one_only_retires():
    member = Member("w0", None)
    for to in (M.READY, M.TRAINING, M.LEAVING, M.LEFT, M.RETIRED):
        member.move(to)
    assert member.state == M.RETIRED
    for now, to in [(M.TRAINING, M.READY), (M.LEAVING, M.TRAINING), (M.DEAD, M.TRAINING), (M.HUNG, M.READY),
                    (M.FINISHED, M.TRAINING), (M.RETIRED, M.DEAD), (M.STOPPED, M.FINISHED), (M.READY, M.STARTING)]:
        member = Member("w1", None, state=now)
        with pytest.raises(IllegalTransition, match=f"member w1 cannot go from {now.value} to {to.value}"):
            member.move(to)
        assert member.state == now  # refused, not made
    for now, to in [(M.DEAD, M.RETIRED), (M.FINISHED, M.STOPPED), (M.STARTING, M.FAILED), (M.READY, M.STOPPED)]:
        member = Member("w2", None, state=now)
        member.move(to)
        assert member.state == to
