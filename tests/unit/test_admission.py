"""Admission (actors/control/admission.py): ready workers join plans together, at workers.min, and
the first joiner after every member was lost starts from the checkpoint. Over a fake worker group:
no Ray."""
from __future__ import annotations

import asyncio
import time

from actors.control.admission import Admission
from actors.control.book import MembershipBook
from actors.control.members import Member
from actors.plan import WorkerSpec
from algorithms.rules.kinds import SYNCHRONOUS
from algorithms.rules.supervision import JobState, MemberState
from core.schema import JobConfig, parse
from orchestrator.config import config_from_dict
from testkit.fake_workers import FakeWorkerGroup

S = MemberState


class History:
    def __init__(self) -> None:
        self.restored: list[int] = []

    def step(self, live=()) -> int:
        return 5

    def restore(self, step: int):
        self.restored.append(step)
        return (step + 1, 8)


class Journal:
    def __init__(self) -> None:
        self.step, self.events = 0, []

    def set_step(self, step: int) -> None:
        self.step = step

    def event(self, kind, reason, **detail):
        self.events.append((kind, reason))


class Checkpoints:
    def __init__(self, whole: bool = True) -> None:
        self.whole = whole
        self.last: tuple[int, str] | None = None
        self.storing: asyncio.Future | None = None
        """A store under way: it ends with the checkpoint it stored (`newest` waits for it)."""

    async def newest(self):
        if self.storing is not None:
            self.last = await self.storing
        return self.last

    async def read(self, path):
        if not self.whole:
            raise RuntimeError("sha256 mismatch")
        return b"state"


class Harness:
    def __init__(self, min_workers: int = 1, whole_checkpoint: bool = True) -> None:
        cfg = parse(JobConfig, config_from_dict({
            "name": "job", "workers": {"count": max(2, min_workers), "min": min_workers, "max": 4},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8},
            "stop": {"max_steps": 10}}).to_dict())
        self.group = FakeWorkerGroup()
        self.book = MembershipBook(cfg, "r", SYNCHRONOUS)
        self.history, self.journal, self.checkpoints = History(), Journal(), Checkpoints(whole_checkpoint)
        self.reshapes: list[tuple] = []
        self.runs: list[str] = []
        self.failures: list[str] = []
        self.looks = 0
        self.admission = Admission(self.book, self.journal, self.checkpoints, self.group, SYNCHRONOUS, min_workers,
                                   lambda: JobState.RUNNING, lambda: True, lambda: self.history,
                                   self.reshape, lambda m: self.runs.append(m.slot), self.fail)
        original = self.book.ready_to_admit

        def counted():
            self.looks += 1
            return original()
        self.book.ready_to_admit = counted

    def member(self, slot: str, state: MemberState, why=("scale", "scale request", 1.0)) -> Member:
        handle = self.group.create(f"job/r/{slot}", WorkerSpec("job", "r", slot, "/tmp", "job", "ns", {}, ()))
        self.book.members[slot] = Member(slot, handle, state=state, join_reason=why)
        return self.book.members[slot]

    def start(self, *slots: str) -> None:
        for slot in slots:
            self.member(slot, S.TRAINING, ("initial membership", "start", 0.0))
        self.book.next_plan(slots, "start", incarnation=0, store_host="h", store_port=0, history_step=0)

    def reshape(self, members, reason, detector, decided, joiners=()):
        self.reshapes.append((members, reason, joiners))
        for slot in members:
            self.book.members[slot].state = S.TRAINING
        self.book.next_plan(members, reason, incarnation=0, store_host="h", store_port=0, history_step=0)

    async def fail(self, reason, detail):
        self.failures.append(reason)


def test_workers_ready_together_are_admitted_by_one_plan_once_every_joiner_of_the_decision_is_up():
    async def scenario():
        h = Harness()
        h.start("w0")
        h.member("w1", S.READY)
        h.member("w2", S.STARTING)
        await h.admission.admit()
        assert h.reshapes == [], "w2 comes from the same decision: one pause for both"
        h.book.members["w2"].state = S.READY
        await h.admission.admit()
        assert h.reshapes == [(("w0", "w1", "w2"), "scale", ("w1", "w2"))] and h.runs == ["w1", "w2"]
    asyncio.run(scenario())


def test_nobody_is_admitted_below_workers_min():
    async def scenario():
        h = Harness(min_workers=3)
        h.start("w0")
        h.member("w1", S.READY)
        await h.admission.admit()
        assert h.reshapes == [], "two members are below workers.min = 3"
        h.member("w2", S.READY)
        await h.admission.admit()
        assert [r[0] for r in h.reshapes] == [("w0", "w1", "w2")]
    asyncio.run(scenario())


def test_requests_in_one_turn_of_the_loop_look_at_the_members_once():
    async def scenario():
        h = Harness()
        h.start("w0")
        for i in range(1, 9):
            h.member(f"w{i}", S.READY)
        for _ in range(8):  # eight joiners became ready in this turn
            await h.admission.request()
        while h.admission._task is not None and not h.admission._task.done():
            await asyncio.sleep(0.001)
        assert h.looks == 1, f"{h.looks} looks at the members for one turn's joiners"
        assert len(h.reshapes) == 1 and len(h.reshapes[0][2]) == 8
    asyncio.run(scenario())


def test_joiners_are_held_while_the_survivors_of_a_departure_have_not_committed():
    async def scenario():
        h = Harness()
        h.start("w0", "w1")
        h.book.open_reshape(h.book.plan, ("w0", "w1", "w2"), "w2 died", "watch", time.time(), leavers=("w2",))
        h.member("w3", S.READY)
        await h.admission.admit()
        assert h.reshapes == [], "held for the survivors' first step without w2"
        h.book.pending.clear()
        await h.admission.admit()
        assert [r[2] for r in h.reshapes] == [("w3",)]
    asyncio.run(scenario())


def test_after_every_member_was_lost_the_first_joiner_starts_from_the_checkpoint():
    async def scenario():
        h = Harness()
        h.start("w0")
        h.book.members["w0"].state = S.DEAD
        h.admission.restore = (4, "/runs/checkpoints/step-00000004.pt")
        h.member("w1", S.READY, ("replace w0", "replacement", 1.0))
        await h.admission.admit()
        assert h.history.restored == [4] and h.journal.step == 4
        assert h.journal.events and h.journal.events[0][0] == "restore" and "steps 5..8" in h.journal.events[0][1]
        assert h.book.members["w1"].holds_state and h.admission.restore is None
        assert [r[0] for r in h.reshapes] == [("w1",)]
    asyncio.run(scenario())


def every_member_lost_while_storing() -> Harness:
    """w0, the only member, dead; the newest durable checkpoint at step 4 and a newer one still being stored."""
    h = Harness()
    h.start("w0")
    h.book.members["w0"].state = S.DEAD
    h.checkpoints.last = h.admission.restore = (4, "/runs/checkpoints/step-00000004.pt")
    h.checkpoints.storing = asyncio.get_running_loop().create_future()
    return h


def test_a_checkpoint_still_being_stored_when_every_member_was_lost_is_the_one_restored():
    """Every member's death is known within milliseconds of the kill (the lifeline), often before the
    store of a checkpoint taken a few steps earlier has ended: the decision saw step 4 as the newest,
    the store of step 8 ends after it. The first joiner starts from step 8, not 4 (its four steps are
    not redone). Switched off (the decision's checkpoint taken as it was), it starts from step 4."""
    async def scenario():
        h = every_member_lost_while_storing()
        h.member("w1", S.READY, ("replace w0", "replacement", 1.0))
        admitting = asyncio.get_running_loop().create_task(h.admission.admit())
        await asyncio.sleep(0)
        assert not admitting.done() and h.history.restored == [], "waits for the store under way"
        h.checkpoints.storing.set_result((8, "/runs/checkpoints/step-00000008.pt"))
        await admitting
        assert h.history.restored == [8] and h.journal.step == 8
        assert "checkpoint at step 8" in h.journal.events[0][1]
    asyncio.run(scenario())


def test_a_joiner_dropped_while_its_restore_is_read_is_never_admitted_and_the_next_joiner_restores():
    """Every member was lost; w1 and w2 are ready, and w1 is to start from the checkpoint. While admission
    waits for the store under way, a scale down drops w1 (actors/control/plans.py `Plans.converge`). No plan names
    the dropped w1 (its move to training would fail the job), and the restore stays for the next joiner."""
    async def scenario():
        h = every_member_lost_while_storing()
        for slot in ("w1", "w2"):
            h.member(slot, S.READY, ("replace w0", "replacement", 1.0))
        admitting = asyncio.get_running_loop().create_task(h.admission.admit())
        await asyncio.sleep(0)
        h.book.members["w1"].move(S.LEFT)
        h.checkpoints.storing.set_result((4, "/runs/checkpoints/step-00000004.pt"))
        await admitting
        assert h.reshapes == [] and h.admission.restore == (4, "/runs/checkpoints/step-00000004.pt")
        h.checkpoints.storing = None
        await h.admission.admit()
        assert [r[0] for r in h.reshapes] == [("w2",)] and h.book.members["w2"].holds_state
    asyncio.run(scenario())


def test_every_member_lost_while_the_first_checkpoint_is_being_stored_restores_from_it_once_stored():
    """The decision saw no stored checkpoint but one being stored at step 8 (restore = (8, "")): the first
    joiner starts from it once its store has ended. A store that then fails ends the job with the reason."""
    async def scenario(stored):
        h = Harness()
        h.start("w0")
        h.book.members["w0"].state = S.DEAD
        h.admission.restore = (8, "")
        h.checkpoints.storing = asyncio.get_running_loop().create_future()
        h.checkpoints.storing.set_result(stored)
        h.member("w1", S.READY, ("replace w0", "replacement", 1.0))
        await h.admission.request()
        await h.admission._task
        return h
    h = asyncio.run(scenario((8, "/runs/checkpoints/step-00000008.pt")))
    assert h.history.restored == [8] and h.failures == []
    h = asyncio.run(scenario(None))
    assert h.history.restored == [] and h.reshapes == [] and len(h.failures) == 1
    assert "checkpoint at step 8, which was being stored then, could not be stored" in h.failures[0]


def test_a_checkpoint_that_is_not_whole_fails_the_job_with_the_reason():
    async def scenario():
        h = Harness(whole_checkpoint=False)
        h.start("w0")
        h.book.members["w0"].state = S.DEAD
        h.admission.restore = (4, "/runs/checkpoints/step-00000004.pt")
        h.member("w1", S.READY, ("replace w0", "replacement", 1.0))
        await h.admission.request()
        await h.admission._task
        assert h.reshapes == [] and len(h.failures) == 1
        assert "checkpoint at step 4 is not whole: sha256 mismatch" in h.failures[0]
    asyncio.run(scenario())
