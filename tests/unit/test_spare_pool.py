"""The spare pool (actors/control/spares.py) over a fake worker group: no Ray."""
from __future__ import annotations

import asyncio

from actors.control.members import Member
from actors.control.spares import SparePool
from actors.plan import WorkerSpec
from testkit.fake_workers import FakeWorkerGroup


def spec(slot: str, incarnation: int = 0) -> WorkerSpec:
    return WorkerSpec("job", "r", slot, "/tmp", "job", "ns", {}, (), incarnation=incarnation)


class Harness:
    def __init__(self, want: int = 1) -> None:
        self.group = FakeWorkerGroup()
        self.saved: list[list[str]] = []
        self.notes: list[str] = []
        self.wanted, self.settled = True, True
        self.pool = SparePool(want, self.group, "job/r", spec, self.save, lambda number, timeout: True,
                              lambda kind, reason, **detail: self.notes.append(reason),
                              wanted=lambda: self.wanted, settled=lambda: self.settled)

    def save(self) -> int:
        self.saved.append(self.pool.names())
        return len(self.saved)

    async def ready(self, count: int) -> None:
        for _ in range(500):
            if sum(s.ready for s in self.pool.spares) >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("spares not ready")


def test_spares_start_with_their_names_saved_first_and_a_slot_adopts_the_oldest():
    async def scenario():
        h = Harness(want=2)
        h.pool.fill()
        assert h.saved == [["job/r/spare1", "job/r/spare2"]], "the names are saved before any actor exists"
        await h.ready(2)
        member = Member("w1", None)
        info = await h.pool.adopt(member, spec("w1", 7), (3,))
        assert info is not None and info.pid == member.handle.pid and member.actor_name == "job/r/spare1"
        assert member.handle.spec.slot == "w1" and member.handle.spec.incarnation == 7, "the spare became w1"
        assert any(n.startswith("w1 is hot spare spare1") for n in h.notes)
        await h.ready(2)
        assert h.pool.names() == ["job/r/spare2", "job/r/spare3"], "a new spare starts behind the one taken"
    asyncio.run(scenario())


async def taken_while_a_reshape_is_pending() -> Harness:
    """A pool whose one ready spare a slot has just adopted while the membership has not settled."""
    h = Harness()
    h.pool.fill()
    await h.ready(1)
    h.settled = False
    await h.pool.adopt(Member("w0", None), spec("w0"), ())
    return h


def test_the_spare_behind_waits_until_the_membership_settles(monkeypatch):
    monkeypatch.setattr("actors.control.spares.SPARE_SETTLE_S", 600.0)  # the fallback is the test below's
    async def scenario():
        h = await taken_while_a_reshape_is_pending()
        await asyncio.sleep(0.2)  # a few of its 0.05-s looks at the membership
        assert not h.pool.spares, "no spare starts while a reshape is pending"
        h.settled = True
        await h.ready(1)
    asyncio.run(scenario())


def test_the_spare_behind_starts_after_spare_settle_s_if_the_membership_never_settles(monkeypatch):
    monkeypatch.setattr("actors.control.spares.SPARE_SETTLE_S", 0.3)
    async def scenario():
        h = await taken_while_a_reshape_is_pending()
        await h.ready(1)  # SPARE_SETTLE_S later, unsettled as it still is
        assert not h.settled
    asyncio.run(scenario())


def test_a_spare_that_died_idle_is_not_adopted_and_the_slot_starts_fresh():
    async def scenario():
        h = Harness()
        h.pool.fill()
        await h.ready(1)
        h.pool.spares[0].handle.alive = False
        member = Member("w0", None)
        assert await h.pool.adopt(member, spec("w0"), ()) is None
        assert member.handle is None and member.actor_name == ""
        assert any("could not become w0" in n for n in h.notes)
    asyncio.run(scenario())


def test_a_spare_whose_start_fails_is_replaced_after_a_pause(monkeypatch):
    monkeypatch.setattr("actors.control.spares.RETRY_AFTER_S", 0.05)
    async def scenario():
        h = Harness()
        h.group.start_failures["spare1"] = "ImportError: no module named x"
        h.pool.fill()
        await h.ready(1)
        assert h.pool.names() == ["job/r/spare2"]
        assert any("spare1 failed to start" in n for n in h.notes)
    asyncio.run(scenario())


def test_no_spares_once_unwanted_and_the_end_kills_them():
    async def scenario():
        h = Harness(want=2)
        h.pool.fill()
        await h.ready(2)
        handles = [s.handle for s in h.pool.spares]
        h.pool.kill_all()
        assert not h.pool.spares and not any(x.alive for x in handles)
        h.wanted = False
        h.pool.fill()
        assert not h.pool.spares
    asyncio.run(scenario())
