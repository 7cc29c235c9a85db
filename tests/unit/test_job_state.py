"""The job's state machine (actors/control/job_state.py) on its own: a transition the table refuses is
not made (nothing recorded, nothing saved), each one it allows is an event and is saved, a terminal one
is announced once its snapshot is saved, and a restarted incarnation carries on from its state file."""
from __future__ import annotations

import pytest

from actors.control.job_state import JobStateMachine
from algorithms.rules.supervision import IllegalTransition, JobState

J = JobState


class Recorded:
    """What the machine tells the journal and the state file."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []
        self.saved = 0
        self.ended: list[tuple[JobState, int]] = []

    def note(self, kind: str, reason: str, **detail) -> None:
        self.events.append((kind, reason, detail))

    def persist(self) -> int:
        self.saved += 1
        return self.saved

    def end(self, state: JobState, number: int) -> None:
        self.ended.append((state, number))


def machine(saved: dict | None = None) -> tuple[JobStateMachine, Recorded]:
    seen = Recorded()
    return JobStateMachine("job", 100.0, seen.note, seen.persist, seen.end, saved), seen


def test_an_illegal_transition_is_refused_and_leaves_no_trace():
    job, seen = machine()
    job.transition(J.RUNNING, "started")
    job.transition(J.FINISHED, "done")
    with pytest.raises(IllegalTransition, match="job job cannot go from FINISHED to RUNNING"):
        job.transition(J.RUNNING, "again")
    assert job.state == J.FINISHED, "the refused move was not made"
    assert [e[2]["state_to"] for e in seen.events] == ["RUNNING", "FINISHED"], "no event for the refused move"
    assert seen.saved == 2 and seen.ended == [(J.FINISHED, 2)]


def test_each_transition_is_an_event_with_its_reason_and_is_saved_unless_the_caller_saves_next():
    job, seen = machine()
    job.transition(J.RUNNING, "2 workers started", members=2)
    assert seen.events == [("transition", "2 workers started", {"state_from": "STARTING", "state_to": "RUNNING",
                                                                 "members": 2})]
    assert seen.saved == 1 and job.ended_at is None
    job.transition(J.RESHAPING, "w1 died", persist=False)
    assert job.state == J.RESHAPING and seen.saved == 1, "the publication that follows saves it"


def test_a_terminal_state_is_saved_and_announced_even_when_the_caller_would_save_next():
    job, seen = machine()
    job.transition(J.FAILED, "no worker could start", persist=False)
    assert seen.saved == 1 and seen.ended == [(J.FAILED, 1)], "the end waits for its own snapshot"
    assert job.ended_at is not None and job.state.terminal and not job.may_start()


def test_a_decided_stop_keeps_workers_from_starting_and_shows_its_cause():
    job, _ = machine()
    job.transition(J.RUNNING, "started")
    assert job.may_start()
    job.decide_stop("FINISHED", "target reached")
    assert (job.stop_kind, job.cause) == ("FINISHED", "target reached") and not job.may_start()
    assert job.snapshot()["stop_kind"] == "FINISHED"


def test_a_restarted_incarnation_carries_on_from_the_saved_state():
    first, _ = machine()
    first.transition(J.RUNNING, "started")
    first.running()
    first.decide_stop("STOPPED", "stop requested")
    again, seen = machine(dict(first.snapshot()))
    assert again.snapshot() == first.snapshot() and again.state == J.RUNNING and again.stop_kind == "STOPPED"
    assert seen.events == [] and seen.saved == 0, "carrying on records and saves nothing by itself"
