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
the next record. The trial is not resumed by a restarted coordinator (its windows are its memory): the
policy running then runs on, and an event says so.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


class Trial:
    def __init__(self, spec: dict, switch: Callable[[dict, str], None], event: Callable[..., None],
                 can_switch: Callable[[], bool]) -> None:
        """`spec`: the config's `policy_trial` ({steps, candidates}); `switch(policy, reason)`: publish the
        members with `policy` (a plan's `Plan.policy`); `event(kind, reason, **detail)`: the journal's;
        `can_switch()`: no reshape pending and no stop decided."""
        self.steps = int(spec["steps"])
        self.candidates: list[dict] = list(spec["candidates"])
        self._switch, self._event, self._can_switch = switch, event, can_switch
        self.running = 0
        """The index of the candidate running (or switched to, until its first record)."""
        self.windows: list[list[tuple[int, float]]] = [[] for _ in self.candidates]
        """(step, time) of each candidate's committed records during its turn."""
        self.chosen: int | None = None
        self.measured: list[float | None] = [None] * len(self.candidates)

    def label(self, index: int) -> str:
        return self.candidates[index]["label"]

    def policy(self, index: int, fresh: bool) -> dict:
        c = self.candidates[index]
        return {"label": c["label"], "sync": c["sync"], "compression": c["compression"], "fresh": fresh}

    def offer(self, record: dict, set_policy: Callable[[dict], None]) -> None:
        """A newest committed record. `set_policy(policy)`: change what later plans carry without
        publishing (a switch committed its first step: no longer fresh)."""
        label = record.get("policy", self.label(0))
        if self._fresh is not None and label == self.label(self._fresh):
            set_policy(self.policy(self._fresh, fresh=False))
            self._fresh = None
        if self.chosen is not None or label != self.label(self.running):
            return  # decided; or a step committed under the previous candidate before the switch was adopted
        window = self.windows[self.running]
        window.append((int(record["step"]), float(record["time"])))
        if window[-1][0] - window[0][0] < self.steps or not self._can_switch():
            return
        (s0, t0), (s1, t1) = window[0], window[-1]
        self.measured[self.running] = (t1 - t0) / (s1 - s0)
        if self.running + 1 < len(self.candidates):
            self.running += 1
            self._publish(self.running, f"policy trial: {self.label(self.running)} for {self.steps} steps "
                                        f"({self.running + 1} of {len(self.candidates)})")
            return
        self._decide()

    _fresh: int | None = None
    """The candidate switched to that has not committed a step yet."""

    def _publish(self, index: int, reason: str) -> None:
        self._fresh = index
        self._switch(self.policy(index, fresh=True), reason)

    def scores(self) -> list[float]:
        return [m * float(c["factor"]) for m, c in zip(self.measured, self.candidates)]  # type: ignore[operator]

    def _decide(self) -> None:
        scores = self.scores()
        best = min(range(len(scores)), key=lambda i: (scores[i], i))
        self.chosen = best
        rows = [{"label": c["label"], "predicted_step_s": c["step_s"], "measured_step_s": m, "factor": c["factor"],
                 "score_s": s, "error": (c["step_s"] - m) / m} for c, m, s in zip(self.candidates, self.measured, scores)]
        told = ", ".join(f"{r['label']} {r['measured_step_s'] * 1e3:.2f} ms/step measured "
                         f"({r['predicted_step_s'] * 1e3:.2f} predicted) x {r['factor']:.2f}" for r in rows)
        reason = f"policy trial: {self.label(best)} runs on ({told})"
        self._event("policy_trial", reason, chosen=self.label(best), candidates=rows,
                    median_error=statistics.median(abs(r["error"]) for r in rows))
        if best != self.running:
            self._publish(best, f"policy trial chose {self.label(best)}")

    def summary(self) -> dict[str, Any]:
        return {"running": self.label(self.chosen if self.chosen is not None else self.running),
                "chosen": None if self.chosen is None else self.label(self.chosen), "measured": self.measured}
