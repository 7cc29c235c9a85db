"""The online trial's decisions (actors/control/trial.py), driven by committed records as the coordinator
offers them: each candidate's turn, the switch, the pick by measured step time times factor, and the
re-trials (a node joins or leaves; a sustained drift of the step time). Pure: no workers."""
from __future__ import annotations

from actors.control.trial import Trial

SPEC = {"steps": 10, "candidates": [
    {"label": "bsp", "sync": {"policy": "bsp"}, "compression": {"codec": "none"}, "step_s": 0.010, "factor": 1.0},
    {"label": "local_sgd h=8", "sync": {"policy": "local_sgd", "h": 8}, "compression": {"codec": "none"},
     "step_s": 0.004, "factor": 1.5},
    {"label": "bsp hierarchical", "sync": {"policy": "bsp", "hierarchical": True}, "compression": {"codec": "none"},
     "step_s": 0.008, "factor": 1.0}]}


class Coordinator:
    """What the trial calls: switches (published policies), events, the policy later plans carry."""

    def __init__(self, spec: dict = SPEC) -> None:
        self.switches: list[dict] = []
        self.events: list[tuple[str, str, dict]] = []
        self.carried: dict | None = None
        self.allowed = True
        self.trial = Trial(spec, lambda policy, reason: self.switches.append(policy),
                           lambda kind, reason, **detail: self.events.append((kind, reason, detail)), lambda: self.allowed)
        self.step, self.time = 0, 0.0

    def run(self, label: str | None, steps: int, step_s: float, round_s: float = 0.0, h: int = 0) -> None:
        """`steps` committed steps of `step_s` each under `label` (None: the config's own, unlabelled); with
        `h`, every step that is a multiple of h also pays a round of `round_s`."""
        for _ in range(steps):
            self.step += 1
            self.time += step_s + (round_s if h and self.step % h == 0 else 0.0)
            record = {"step": self.step, "time": self.time}
            if label is not None:
                record["policy"] = label
            self.trial.offer(record, lambda policy: setattr(self, "carried", policy))


def test_each_candidate_runs_its_turn_and_the_best_measured_times_its_factor_runs_on():
    c = Coordinator()
    c.run(None, 11, 0.010)  # bsp, the config's policy: 10 steps after its first record
    assert [p["label"] for p in c.switches] == ["local_sgd h=8"] and c.switches[0]["fresh"]
    c.run("bsp", 2, 0.010)  # adopted at the next commit: steps still committed under bsp do not count
    c.run("local_sgd h=8", 17, 0.005)  # its turn: 10 steps rounded up to whole rounds of 8, 16
    assert c.carried == {**c.trial.policy(1, False)}  # its first committed step: later plans carry it, not fresh
    assert [p["label"] for p in c.switches] == ["local_sgd h=8", "bsp hierarchical"]
    c.run("bsp hierarchical", 11, 0.009)
    # measured: bsp 10 ms, local_sgd 5 ms x 1.5 = 7.5, hierarchical 9 ms: local_sgd wins; it is switched back to
    [(kind, reason, detail)] = [e for e in c.events if e[0] == "policy_trial"]
    assert detail["chosen"] == "local_sgd h=8" and [p["label"] for p in c.switches][-1] == "local_sgd h=8"
    measured = {r["label"]: round(r["measured_step_s"], 6) for r in detail["candidates"]}
    assert measured == {"bsp": 0.010, "local_sgd h=8": 0.005, "bsp hierarchical": 0.009}
    assert {r["label"]: r["predicted_step_s"] for r in detail["candidates"]} == {"bsp": 0.010, "local_sgd h=8": 0.004,
                                                                                  "bsp hierarchical": 0.008}


def test_the_last_candidate_winning_needs_no_switch_and_a_busy_job_delays_one():
    c = Coordinator({**SPEC, "candidates": [SPEC["candidates"][0], SPEC["candidates"][2]]})
    c.allowed = False  # a reshape pending: the turn is over but the switch waits
    c.run(None, 14, 0.010)
    assert c.switches == []
    c.allowed = True
    c.run(None, 1, 0.010)
    assert [p["label"] for p in c.switches] == ["bsp hierarchical"]
    c.run("bsp hierarchical", 11, 0.008)
    assert [e[2]["chosen"] for e in c.events if e[0] == "policy_trial"] == ["bsp hierarchical"]
    assert len(c.switches) == 1  # it was running already


def test_a_node_joining_after_the_decision_runs_the_trial_again_starting_with_the_running_policy():
    c = Coordinator({**SPEC, "candidates": SPEC["candidates"][:2]})
    c.trial.membership(("n0", "n0", "n1", "n1"))
    c.run(None, 11, 0.010)
    c.run("local_sgd h=8", 17, 0.020)  # bsp wins (10 ms against 30)
    assert c.trial.chosen == 0 and [p["label"] for p in c.switches] == ["local_sgd h=8", "bsp"]
    c.trial.membership(("n0", "n0", "n1", "n1"))  # the same nodes (a worker replaced on one): nothing
    assert not [e for e in c.events if e[0] == "policy_retrial"]
    c.trial.membership(("n0", "n0", "n1", "n1", "n2"))  # a node joined
    [(_, reason, detail)] = [e for e in c.events if e[0] == "policy_retrial"]
    assert "nodes changed (2 -> 3" in reason and detail["running"] == "bsp"
    c.run("bsp", 11, 0.010)  # bsp's turn again, where it is: then local_sgd's
    assert [p["label"] for p in c.switches] == ["local_sgd h=8", "bsp", "local_sgd h=8"]


def test_a_sustained_drift_runs_the_trial_again_and_one_slow_window_does_not():
    c = Coordinator({**SPEC, "candidates": SPEC["candidates"][:2]})
    c.run(None, 11, 0.010)
    c.run("local_sgd h=8", 17, 0.020)
    c.run("bsp", 1, 0.010)
    c.run("bsp", 20, 0.020)  # one window 2x slower (a recovery): not yet
    c.run("bsp", 20, 0.010)
    assert not [e for e in c.events if e[0] == "policy_retrial"]
    c.run("bsp", 41, 0.015)  # two windows 50% slower in a row
    [(_, reason, _)] = [e for e in c.events if e[0] == "policy_retrial"]
    assert "drifted +50%" in reason, reason


def test_a_periodic_candidates_turn_spans_whole_rounds_so_its_step_time_carries_their_cost():
    """local_sgd h=8: 4-ms local steps, and every 8th step a 16-ms round: 4 + 16/8 = 6 ms a step in the long
    run. Its turn, from its first committed step (step 12 here), is 10 steps rounded up to 16: it spans
    exactly two rounds (steps 16 and 24), (16 x 4 + 2 x 16) / 16 = 6 ms. A 10-step turn (steps 12 to 22)
    would have seen one round: (10 x 4 + 16) / 10 = 5.6 ms. Where the switch has to wait (a reshape
    pending) past the turn's end, the steps after it are not counted: to step 31, (19 x 4 + 2 x 16) / 19
    = 5.7 ms."""
    c = Coordinator({**SPEC, "candidates": SPEC["candidates"][:2]})
    c.run(None, 11, 0.010)
    assert [p["label"] for p in c.switches] == ["local_sgd h=8"]
    assert c.switches[0]["turn_steps"] == 16 and c.trial.policy(0, True)["turn_steps"] == 10
    c.allowed = False
    c.run("local_sgd h=8", 19, 0.004, round_s=0.016, h=8)  # steps 12..30
    c.allowed = True
    c.run("local_sgd h=8", 1, 0.004, round_s=0.016, h=8)  # step 31
    [(_, _, detail)] = [e for e in c.events if e[0] == "policy_trial"]
    measured = {r["label"]: r["measured_step_s"] for r in detail["candidates"]}
    assert abs(measured["local_sgd h=8"] - 0.006) < 1e-9
    assert "turn_steps" not in c.trial.policy(1, False)  # decided: later plans carry no turn
