"""elastic_bsp's barrier rounds: where each member's barrier push falls, and when a round is complete.

The round under way (`BarrierRound`) names, for every member in it, the clock whose push is its
barrier push; that push is staged, and its puller waits, until every member of the round has sent its
own; then `ServerCore` (algorithms/policies/server.py) applies them as one update and the next round begins. A
round begins with each member's barrier `r` iterations ahead (`fallback`), which the coordinator's
ZipLine schedule (algorithms/rules/zipline.py) replaces when it comes in time (`take_schedule`). A joiner
waits for the next round; a departure releases a barrier that waited only for the departed.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BarrierRound:
    """elastic_bsp: the barrier the live members are heading for. Each member's barrier push is the
    push of clock `at[slot]`; it waits (staged) until every member of the round has sent its own,
    and then they are applied as one update and the next round begins."""

    index: int = 0
    """Barriers passed before this one."""
    at: dict[str, int] = field(default_factory=dict)
    """slot -> the clock whose push is its barrier push (members of this round only: a joiner waits
    for the next round)."""
    began: dict[str, int] = field(default_factory=dict)
    """slot -> its clock when the round began (a schedule counts iterations from there)."""
    staged: dict[str, dict] = field(default_factory=dict)
    """slot -> its barrier push, once sent (a departed member's stays: it is good work)."""
    scheduled: bool = False
    """Whether the coordinator's ZipLine schedule replaced the fallback (a barrier after `r`)."""

    def complete(self) -> bool:
        return bool(self.staged) and all(slot in self.staged for slot in self.at)

    def open_for(self, slot: str, clocks: dict[str, int]) -> bool:
        """Whether `slot` may pull: it is in the round and its clock (in `clocks`) has not passed its barrier."""
        at = self.at.get(slot)
        return at is not None and clocks[slot] <= at

    def fallback(self, clocks: dict[str, int], r: int) -> None:
        """Every live member's barrier after `r` more iterations from its clock in `clocks`."""
        self.began = dict(clocks)
        self.at = {slot: clock + r - 1 for slot, clock in clocks.items()}

    def take_schedule(self, index: int, iterations: dict[str, int], r: int, clocks: dict[str, int]) -> bool:
        """The coordinator's schedule for round `index`: after how many iterations (1..r) each member
        synchronizes. Taken once, only for this round, naming exactly its members, when no member has
        passed the iteration it names yet (`clocks`: each member's clock now); False otherwise."""
        if index != self.index or self.scheduled or set(iterations) != set(self.at):
            return False
        at = {slot: self.began[slot] + int(k) - 1 for slot, k in iterations.items()}
        if any(not 1 <= k <= r for k in iterations.values()) or self.staged or any(at[s] < clocks[s] for s in at):
            return False
        self.at, self.scheduled = at, True
        return True

    def state_dict(self) -> dict:
        return {"index": self.index, "at": dict(self.at), "began": dict(self.began),
                "staged": {s: dict(p) for s, p in self.staged.items()}, "scheduled": self.scheduled}

    @classmethod
    def from_state(cls, state: dict) -> BarrierRound:
        return cls(state["index"], dict(state["at"]), dict(state["began"]),
                   {s: dict(p) for s, p in state["staged"].items()}, state["scheduled"])
