"""A member's side of `sync.auto`'s trial (actors/training/replica_reports.py `_turn_ends`): the record of a
turn's last step goes to the coordinator at once, not at the member's next timed report, so the trial's next
candidate starts without the running one going on for up to a report's interval."""
from __future__ import annotations

from types import SimpleNamespace

from actors.training.replica_reports import Reporting

TRIAL = {"steps": 10, "candidates": [{"label": "bsp", "sync": {"policy": "bsp"}},
                                     {"label": "local_sgd h=8", "sync": {"policy": "local_sgd", "h": 8}}]}


def member(trial: dict | None = TRIAL, reports: bool = True) -> SimpleNamespace:
    return SimpleNamespace(cfg=SimpleNamespace(policy_trial=trial or {}), _turn=None, step=0,
                           _reports=lambda plan: reports)


def ends(m: SimpleNamespace, policy: dict | None, steps: int) -> list[int]:
    """The steps among the next `steps` commits at which the member reports at once."""
    plan = SimpleNamespace(policy=policy)
    out = []
    for _ in range(steps):
        m.step += 1
        if Reporting._turn_ends(m, plan):  # type: ignore[arg-type]
            out.append(m.step)
    return out


def test_a_turns_last_step_is_reported_at_once_and_only_it():
    m = member()
    # the config's own policy (the first candidate) from step 1: its turn ends 10 steps after its first
    assert ends(m, None, 25) == [11]
    # the switch: the plan names the candidate and its turn (10 rounded up to whole rounds of 8)
    switched = {"label": "local_sgd h=8", "turn_steps": 16}
    assert ends(m, switched, 40) == [26 + 16]
    # decided: later plans carry no turn, and nothing is reported early
    assert ends(m, {"label": "bsp"}, 40) == []


def test_no_trial_or_a_member_that_does_not_report_never_reports_early():
    assert ends(member(trial=None), None, 30) == []
    assert ends(member(reports=False), {"label": "local_sgd h=8", "turn_steps": 16}, 40) == []
