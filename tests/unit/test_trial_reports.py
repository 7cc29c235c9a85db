"""A member's side of `sync.auto`'s trial (actors/training/reporter.py `TrialTurn`): the record of a turn's last
step goes to the coordinator at once, not at the member's next timed report, so the trial's next candidate
starts without the running one going on for up to a report's interval."""
from __future__ import annotations

from types import SimpleNamespace

from actors.training.reporter import TrialTurn

TRIAL = {"steps": 10, "candidates": [{"label": "bsp", "sync": {"policy": "bsp"}},
                                     {"label": "local_sgd h=8", "sync": {"policy": "local_sgd", "h": 8}}]}


class Member:
    """The commits of one member and the steps at which its turn ends."""

    def __init__(self, trial: dict | None = TRIAL, reports: bool = True) -> None:
        self.turn, self.step, self.reports = TrialTurn(trial or {}), 0, reports

    def ends(self, policy: dict | None, steps: int) -> list[int]:
        """The steps among the next `steps` commits at which the member reports at once."""
        plan = SimpleNamespace(policy=policy)
        out = []
        for _ in range(steps):
            self.step += 1
            if self.turn.ends(plan, self.step, self.reports):
                out.append(self.step)
        return out


def test_a_turns_last_step_is_reported_at_once_and_only_it():
    m = Member()
    # the config's own policy (the first candidate) from step 1: its turn ends 10 steps after its first
    assert m.ends(None, 25) == [11]
    # the switch: the plan names the candidate and its turn (10 rounded up to whole rounds of 8)
    switched = {"label": "local_sgd h=8", "turn_steps": 16}
    assert m.ends(switched, 40) == [26 + 16]
    # decided: later plans carry no turn, and nothing is reported early
    assert m.ends({"label": "bsp"}, 40) == []


def test_no_trial_or_a_member_that_does_not_report_never_reports_early():
    assert Member(trial=None).ends(None, 30) == []
    assert Member(reports=False).ends({"label": "local_sgd h=8", "turn_steps": 16}, 40) == []
