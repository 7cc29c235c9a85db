"""The `replicated` entry (actors/training/entry.py) run by fake members over a real in-process gloo group: who
loads whose committed state when a membership epoch begins."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from actors.training.entry import enter_replicated
from testkit.harness import local_group


class FakeMember:
    def __init__(self, mark: int, digest: int, step: int, agree: bool) -> None:
        self.mark, self.digest, self.step = mark, digest, step
        self.holds_state, self.plan = True, None
        self.impl = SimpleNamespace(replicas_agree_at_commit=agree)
        self.loaded: list[int] = []
        self.rewound = False

    def committed_view(self):
        return self.mark, self.digest

    def committed_state(self) -> dict:
        return {"digest": torch.tensor([self.digest])}

    def load_received(self, state: dict) -> None:
        self.loaded.append(int(state["digest"][0]))

    def rewind(self) -> None:
        self.rewound = True


def enter_all(members: list[FakeMember]) -> list:
    comms = local_group(len(members), name=f"entry-{id(members)}")
    with ThreadPoolExecutor(len(members)) as pool:
        return list(pool.map(lambda mc: enter_replicated(*mc), zip(members, comms)))


def test_replicas_that_differ_by_design_keep_their_own_committed_progress():
    """Streaming DiLoCo with several fragments (or alpha < 1): at a commit point each member's
    replica holds its own unsynchronized progress on the fragments not merged at that round. A new
    membership epoch must not overwrite it with rank 0's: only a member behind (an older committed
    step) loads."""
    members = [FakeMember(12, 101, 12, agree=False), FakeMember(12, 102, 13, agree=False),
               FakeMember(8, 103, 9, agree=False)]
    sources = enter_all(members)
    print(f"loaded: {[m.loaded for m in members]}, sources {sources}, rewound {[m.rewound for m in members]}")
    assert members[0].loaded == [] and members[1].loaded == [], "a member at the newest step lost its own progress"
    assert members[2].loaded == [101] and sources == [None, None, 0], "the member behind takes the newest state"
    assert members[1].rewound, "local steps past the commit point are provisional: back to the commit"


def test_replicas_that_agree_at_commit_points_take_the_newest_holders_state_on_any_difference():
    members = [FakeMember(12, 101, 12, agree=True), FakeMember(12, 102, 12, agree=True)]
    enter_all(members)
    assert members[1].loaded == [101], "a different state at the same step is a split commit: rank 0's wins"
