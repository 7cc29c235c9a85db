"""The online trial of `sync.policy: auto` with `sync.auto.trial_steps` (orchestrator/planner.py picks
the shortlist; this component runs it on the coordinator).

The candidates run in turn, each for `trial_steps` committed steps, measured from the job's own history:
a candidate's step time is the time between its first and last committed records over the steps between
them (so its first step, which includes the switch's re-formed group, is not counted). Once every one
has run, the job runs the one whose measured step time times its convergence factor (1 for an exact
policy) is lowest, and the trial's event records each candidate's predicted and measured step time.

A switch is a publication of the same members as a new membership epoch whose plan carries the policy
(`Plan.policy`): the members adopt it together at a commit vote, re-form, and run it from there (actors/
replica.py `_switch_policy`); the plan is `fresh` until the new policy commits a step, so the epoch's
members take rank 0's state once they have entered (a periodic policy's optimizer state is each
member's own). No switch is published while a reshape is pending or once a stop is decided; it waits for
the next record.

Re-planning: once decided, the trial runs again (starting with the policy running, so the first turn
needs no switch) when a membership change moves the network's shape (the set of nodes the members run
on changes: a node joined or left), or when the chosen policy's step time, measured over windows of
`2 * trial_steps` steps (at least 20), is more than 25% from what the trial measured for two windows in
a row. The trial is not resumed by a restarted coordinator (its windows are its memory): the policy
running then runs on, and an event says so.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

from actors.plan import turn_steps

DRIFT = 0.25
"""A chosen policy whose step time moves this far from its trial's measurement, sustained, is re-tried."""
DRIFT_WINDOWS = 2
"""How many windows in a row the drift must hold (one slow window, a recovery's, is not a drift)."""


class Trial:
    def __init__(self, spec: dict, switch: Callable[[dict, str], None], event: Callable[..., None],
                 can_switch: Callable[[], bool]) -> None:
        """`spec`: the config's `policy_trial` ({steps, candidates}); `switch(policy, reason)`: publish the
        members with `policy` (a plan's `Plan.policy`); `event(kind, reason, **detail)`: the journal's;
        `can_switch()`: no reshape pending and no stop decided."""
        self.steps = int(spec["steps"])
        self.candidates: list[dict] = list(spec["candidates"])
        self._switch, self._event, self._can_switch = switch, event, can_switch
        self.order: list[int] = list(range(len(self.candidates)))
        """The candidates of this round of the trial, in turn (a re-trial starts with the one running)."""
        self.turn = 0
        self.windows: list[list[tuple[int, float]]] = [[] for _ in self.candidates]
        """(step, time) of each candidate's committed records during its turn."""
        self.measured: list[float | None] = [None] * len(self.candidates)
        self.chosen: int | None = None
        self.rounds = 1
        self._fresh: int | None = None
        """The candidate switched to that has not committed a step yet."""
        self._nodes: frozenset[str] | None = None
        """The nodes the members ran on when the trial decided."""
        self._watch: list[tuple[int, float]] = []
        self._drifted = 0

    @property
    def running(self) -> int:
        return self.chosen if self.chosen is not None else self.order[self.turn]

    def label(self, index: int) -> str:
        return self.candidates[index]["label"]

    def policy(self, index: int, fresh: bool) -> dict:
        """What a plan carries to switch to candidate `index`; during the trial also its turn's length, so
        the members report the turn's last step at once rather than at their next report."""
        c = self.candidates[index]
        policy = {"label": c["label"], "sync": c["sync"], "compression": c["compression"], "fresh": fresh}
        if self.chosen is None:
            policy["turn_steps"] = self.length(index)
        return policy

    def length(self, index: int) -> int:
        """Candidate `index`'s turn in steps: `trial_steps`, rounded up to whole rounds of a periodic kind
        (h local steps per round), so its measured step time carries its share of every round."""
        return turn_steps(self.candidates[index], self.steps)

    # ------------------------------------------------------------------ what the coordinator calls
    def offer(self, record: dict, set_policy: Callable[[dict], None]) -> None:
        """A newest committed record. `set_policy(policy)`: change what later plans carry without
        publishing (a switch committed its first step: no longer fresh)."""
        label = record.get("policy", self.label(0))
        if self._fresh is not None and label == self.label(self._fresh):
            set_policy(self.policy(self._fresh, fresh=False))
            self._fresh = None
        if label != self.label(self.running):
            return  # a step committed under the previous candidate before the members adopted the switch
        point = (int(record["step"]), float(record["time"]))
        if self.chosen is not None:
            self._check_drift(point)
            return
        window = self.windows[self.running]
        window.append(point)
        length = self.length(self.running)
        if window[-1][0] - window[0][0] < length or not self._can_switch():
            return
        self.measured[self.running] = _rate(whole_turns(window, length))
        if self.turn + 1 < len(self.order):
            self.turn += 1
            self._publish(self.running, f"policy trial: {self.label(self.running)} for {self.steps} steps "
                                        f"({self.turn + 1} of {len(self.order)})")
            return
        self._decide()

    def membership(self, nodes: tuple[str, ...]) -> None:
        """A plan was published over members on `nodes`: once decided, a change of the set of nodes
        (a node joined or left) runs the trial again."""
        now = frozenset(nodes)
        if self.chosen is None or self._nodes is None:
            self._nodes = now
            return
        if now != self._nodes:
            self._again(f"the members' nodes changed ({len(self._nodes)} -> {len(now)} node(s))")
            self._nodes = now

    # ------------------------------------------------------------------ inside
    def _publish(self, index: int, reason: str) -> None:
        self._fresh = index
        self._switch(self.policy(index, fresh=True), reason)

    def scores(self) -> list[float]:
        return [m * float(c["factor"]) for m, c in zip(self.measured, self.candidates)]  # type: ignore[operator]

    def _decide(self) -> None:
        scores = self.scores()
        best = min(range(len(scores)), key=lambda i: (scores[i], i))
        was = self.running
        self.chosen = best
        self._watch, self._drifted = [], 0
        rows = [{"label": c["label"], "predicted_step_s": c["step_s"], "measured_step_s": m, "factor": c["factor"],
                 "score_s": s, "error": (c["step_s"] - m) / m} for c, m, s in zip(self.candidates, self.measured, scores)]
        told = ", ".join(f"{r['label']} {r['measured_step_s'] * 1e3:.2f} ms/step measured "
                         f"({r['predicted_step_s'] * 1e3:.2f} predicted) x {r['factor']:.2f}" for r in rows)
        reason = f"policy trial: {self.label(best)} runs on ({told})"
        self._event("policy_trial", reason, chosen=self.label(best), candidates=rows, round=self.rounds,
                    median_error=statistics.median(abs(r["error"]) for r in rows))
        if best != was:
            self._publish(best, f"policy trial chose {self.label(best)}")

    def _check_drift(self, point: tuple[int, float]) -> None:
        self._watch.append(point)
        span = max(2 * self.steps, 20)
        if self._watch[-1][0] - self._watch[0][0] < span:
            return
        now, self._watch = _rate(self._watch), [point]
        base = self.measured[self.running]
        if not base:
            return  # decided on a measurement of its own turn: never None once chosen
        off = (now - base) / base
        self._drifted = self._drifted + 1 if abs(off) > DRIFT else 0
        if self._drifted >= DRIFT_WINDOWS:
            self._again(f"{self.label(self.running)}'s step time drifted {off:+.0%} from its trial's "
                        f"{base * 1e3:.2f} ms ({now * 1e3:.2f} ms over the last {span}+ steps)")

    def _again(self, why: str) -> None:
        """Run the trial again, the policy running first (its first turn needs no switch)."""
        current = self.running
        self.rounds += 1
        self.order = [current] + [i for i in range(len(self.candidates)) if i != current]
        self.turn, self.chosen = 0, None
        self.windows = [[] for _ in self.candidates]
        self.measured = [None] * len(self.candidates)
        self._event("policy_retrial", f"policy trial again: {why}", round=self.rounds, running=self.label(current))


def whole_turns(points: list[tuple[int, float]], length: int) -> list[tuple[int, float]]:
    """`points` up to the last one a whole number of turns of `length` steps after the first (a record
    that arrived late, in the same report as the turn's last step, would add part of a round); all of
    them where commits jumped past every such step."""
    s0 = points[0][0]
    ends = [i for i, (step, _) in enumerate(points) if step > s0 and (step - s0) % length == 0]
    return points[:ends[-1] + 1] if ends else points


def _rate(points: list[tuple[int, float]]) -> float:
    """Seconds per step between the first and last (step, time) points."""
    (s0, t0), (s1, t1) = points[0], points[-1]
    return (t1 - t0) / (s1 - s0)
