"""Which members are stragglers: a pure watch over the step-time estimates the members report.

Each member reports an EWMA of its own compute time per step (forward, backward and, for a
modelled straggler, its injected sleep) with every progress report. A member is a straggler when
its estimate is more than `threshold` times the median of the live members' estimates; it stops
being one when it falls below `threshold * release` (hysteresis, so a member near the line does
not flap). Members with no estimate yet are left out, and so is everything while fewer than two
members have one (a median of one says nothing). `update` returns what changed, for events.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class StragglerChange:
    slot: str
    straggler: bool
    """True: it became one; False: it stopped being one (or left)."""
    ratio: float
    """Its estimate over the median when the change was seen (0 when it left)."""


class StragglerWatch:
    def __init__(self, threshold: float = 1.5, release: float = 0.9) -> None:
        if threshold <= 1.0:
            raise ValueError(f"threshold must be > 1, got {threshold}")
        if not 0 < release <= 1:
            raise ValueError(f"release must be in (0, 1], got {release}")
        self.threshold, self.release = threshold, release
        self.current: dict[str, float] = {}
        """The stragglers now, with their ratio to the median."""

    @staticmethod
    def ratios(estimates: Mapping[str, float]) -> dict[str, float]:
        """Each member's estimate over the median of those with one (empty below two members)."""
        known = {slot: s for slot, s in estimates.items() if s > 0}
        if len(known) < 2:
            return {}
        median = statistics.median(known.values())
        return {slot: s / median for slot, s in known.items()}

    def update(self, estimates: Mapping[str, float]) -> list[StragglerChange]:
        """The live members' estimates (slot -> seconds per step); what changed since the last call."""
        ratios = self.ratios(estimates)
        changes = []
        for slot in sorted(set(self.current) - set(estimates)):
            del self.current[slot]
            changes.append(StragglerChange(slot, False, 0.0))
        for slot, ratio in sorted(ratios.items()):
            was = slot in self.current
            now = ratio > self.threshold if not was else ratio >= self.threshold * self.release
            if now:
                self.current[slot] = ratio
            elif was:
                del self.current[slot]
            if now != was:
                changes.append(StragglerChange(slot, now, ratio))
        return changes
