"""The launcher (actors/control/launcher.py) over a fake worker group: no Ray."""
from __future__ import annotations

import asyncio

from actors.control.book import MembershipBook
from actors.control.launcher import Launcher
from actors.control.spares import SparePool
from actors.plan import WorkerSpec
from algorithms.rules.kinds import SYNCHRONOUS
from algorithms.rules.supervision import JobState, MemberState
from core.schema import JobConfig, parse
from orchestrator.config import config_from_dict
from testkit.fake_workers import FakeWorkerGroup

S = MemberState


class Harness:
    def __init__(self, spares: int = 0, budget: int = 3) -> None:
        cfg = parse(JobConfig, config_from_dict({
            "name": "job", "workers": {"count": 2, "max": 4, "failure_budget": budget, "spares": spares},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8},
            "stop": {"max_steps": 10}}).to_dict())
        self.group = FakeWorkerGroup()
        self.book = MembershipBook(cfg, "r", SYNCHRONOUS)
        self.notes: list[tuple[str, str]] = []
        self.admits = 0
        self.may_start = True
        spec = lambda slot, inc=0: WorkerSpec("job", "r", slot, "/tmp", "job", "ns", {}, (), incarnation=inc)  # noqa: E731
        note = lambda kind, reason, **d: self.notes.append((kind, reason))  # noqa: E731
        self.pool = SparePool(spares, self.group, "job/r", spec, lambda: 0, lambda n, t: True, note,
                              wanted=lambda: True, settled=lambda: True)
        self.launcher = Launcher(self.book, self.pool, self.group, "job/r", spec, lambda: (), note,
                                 lambda: JobState.RUNNING, lambda: self.may_start, self.admit)

    async def admit(self) -> None:
        self.admits += 1

    async def until(self, condition, what: str) -> None:
        for _ in range(500):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(what)


def test_each_start_is_a_new_incarnation_and_a_ready_worker_is_admitted():
    async def scenario():
        h = Harness()
        h.launcher.spawn(["w0", "w1"], "initial membership", "start")
        await h.until(lambda: h.book.slots_in(S.READY) == ["w0", "w1"], "both ready")
        assert [h.book.members[s].incarnation for s in ("w0", "w1")] == [1, 2] and h.admits == 2
        assert h.book.members["w0"].join_reason[:2] == ("initial membership", "start")
        assert h.group.current("w1").spec.incarnation == 2
    asyncio.run(scenario())


def test_a_ready_spare_is_used_before_a_fresh_actor():
    async def scenario():
        h = Harness(spares=1)
        h.pool.fill()
        await h.until(lambda: h.pool.spares and h.pool.spares[0].ready, "a ready spare")
        spare = h.pool.spares[0]
        h.launcher.spawn(["w0"], "replace", "replacement")
        await h.until(lambda: h.book.slots_in(S.READY) == ["w0"], "w0 ready")
        assert h.book.members["w0"].handle is spare.handle
        assert "job/r/w0" not in {w.name for w in h.group.workers.values()}, "no fresh actor was created"
    asyncio.run(scenario())


def test_a_spare_is_adopted_only_once_the_survivors_of_a_departure_have_committed_without_it():
    """The survivors of a death re-form on the node's cores: a spare's adoption (its replica built) waits
    for their first step without the dead member, as a fresh start does. Switched off, the spare is taken
    while the departure is still held."""
    async def scenario():
        h = Harness(spares=1)
        h.pool.fill()
        await h.until(lambda: h.pool.spares and h.pool.spares[0].ready, "a ready spare")
        spare = h.pool.spares[0]
        held, looks = [True], [0]

        def held_departure(state):
            looks[0] += 1
            return held[0]
        h.book.held_departure = held_departure  # type: ignore[method-assign]
        h.launcher.spawn(["w0"], "replace", "replacement")
        await h.until(lambda: looks[0] >= 3, "the departure looked at while held")
        assert h.book.members["w0"].state == S.STARTING and h.book.members["w0"].handle is None, \
            "no spare adopted while the survivors have not committed"
        assert spare in h.pool.spares
        held[0] = False
        await h.until(lambda: h.book.slots_in(S.READY) == ["w0"], "w0 ready once the departure settled")
        assert h.book.members["w0"].handle is spare.handle
    asyncio.run(scenario())


def test_a_start_that_fails_is_tried_again_until_the_budget_retires_the_slot(monkeypatch):
    monkeypatch.setattr("actors.control.launcher.RESTART_AFTER_S", 0.01)
    async def scenario():
        h = Harness(budget=3)
        h.group.start_failures["w1"] = "ValueError: no"
        h.launcher.spawn(["w1"], "start", "start")
        await h.until(lambda: "w1" in h.book.retired, "w1 retired")
        assert h.book.failures["w1"] == 3 and h.book.members["w1"].state == S.RETIRED
        assert [k for k, _ in h.notes] == ["failure", "failure", "retired"]
        started = [w for w in h.group.workers.values() if w.slot == "w1"]
        assert len(started) == 3 and not any(w.alive for w in started), "each failed start's actor is killed"
    asyncio.run(scenario())


def test_no_worker_is_started_once_a_stop_is_decided():
    async def scenario():
        h = Harness()
        h.may_start = False
        h.launcher.spawn(["w0"], "start", "start")
        await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()))  # its bring-up ended
        assert not h.group.workers and h.book.members["w0"].state == S.STARTING and h.admits == 0
    asyncio.run(scenario())


def test_a_replacement_waits_for_its_slots_previous_actor_name(monkeypatch):
    monkeypatch.setattr("actors.control.launcher.NAME_RELEASE_WAIT_S", 0.01)
    async def scenario():
        h = Harness()
        old = h.group.create("job/r/w0", WorkerSpec("job", "r", "w0", "/tmp", "job", "ns", {}, ()))
        h.launcher.spawn(["w0"], "replace", "replacement")
        await asyncio.sleep(0.1)
        assert h.book.members["w0"].state == S.STARTING, "not while the old actor holds the name"
        old.alive = False
        await h.until(lambda: h.book.members["w0"].state == S.READY, "started once the name is free")
    asyncio.run(scenario())


def test_the_first_members_wait_placed_workers_out_and_name_what_cannot_be_placed():
    async def scenario():
        h = Harness()
        h.book.cfg.workers.pause_after_s = 0.05  # type: ignore[misc]
        said: list[tuple[bool, str]] = []
        h.group.ready_delay_s = 0.4  # placed, still importing
        h.launcher.spawn(["w0", "w1"], "initial membership", "start")
        assert await h.launcher.first_members(lambda unplaced, cause: said.append((unplaced, cause))) == ("w0", "w1")
        assert said and not any(unplaced for unplaced, _ in said), "placed workers that start slowly are not PAUSED"
        assert "2 of 2 workers placed, 0 up" in said[0][1]
        h2 = Harness()
        h2.book.cfg.workers.pause_after_s = 0.05  # type: ignore[misc]
        h2.group.unplaced = True
        h2.launcher.spawn(["w0", "w1"], "initial membership", "start")
        said.clear()
        waiting = asyncio.get_running_loop().create_task(
            h2.launcher.first_members(lambda unplaced, cause: said.append((unplaced, cause))))
        await h2.until(lambda: said, "an explanation")
        assert said[0][0] and "cannot be placed: each needs 1 CPUs, the cluster has 0 CPUs free" in said[0][1], said
        h2.group.place()
        assert await waiting == ("w0", "w1")
    asyncio.run(scenario())


def test_the_first_members_fail_at_once_when_every_slot_started_is_retired(monkeypatch):
    """Every worker's start raises (the workload's constructor): once each started slot is retired by
    its budget, nothing can ever become ready, so the wait ends with the first worker's error (the job
    ends FAILED) instead of sitting in STARTING; free slots above `count` (max 4 here) are not a reason to
    wait, since nothing starts them before the first plan."""
    monkeypatch.setattr("actors.control.launcher.RESTART_AFTER_S", 0.01)
    async def scenario():
        h = Harness(budget=2)
        h.group.start_failures["w0"] = "ValueError: the workload cannot be built"
        h.group.start_failures["w1"] = "ValueError: the workload cannot be built"
        h.launcher.spawn(["w0", "w1"], "initial membership", "start")
        try:  # the bound is the mechanism under test (a wait that never ends), with a wide margin
            await asyncio.wait_for(h.launcher.first_members(lambda unplaced, cause: None), 30)
        except asyncio.TimeoutError:
            raise AssertionError("still waiting for workers 30 s after every slot was retired") from None
        except RuntimeError as err:
            assert "ValueError: the workload cannot be built" in str(err), err
            assert "w0" in str(err) and "w1" in str(err)
        else:
            raise AssertionError("no member can be ready, yet the first members were returned")
    asyncio.run(scenario())


def test_a_slot_waiting_for_a_spare_whose_start_fails_starts_a_new_actor(monkeypatch):
    """w0 waits for the spare still starting (no ready one); the spare's start fails: w0 is woken and,
    with no spare left on its way, starts a new actor instead of waiting for the next spare (which starts
    only RETRY_AFTER_S later)."""
    monkeypatch.setattr("actors.control.spares.RETRY_AFTER_S", 600.0)
    async def scenario():
        h = Harness(spares=1)
        h.group.hold("job/r/spare1")
        h.group.start_failures["spare1"] = "ImportError: no module named x"
        h.pool.fill()
        await h.until(lambda: h.pool.spares and h.pool.spares[0].handle is not None, "the spare's actor")
        h.launcher.spawn(["w0"], "replace", "replacement")
        await h.until(lambda: h.book.members["w0"].waiting_for, "w0 waiting for the spare")
        h.group.release("job/r/spare1")
        await h.until(lambda: h.book.slots_in(S.READY) == ["w0"], "w0 ready on a new actor")
        assert h.book.members["w0"].handle.name == "job/r/w0" and not h.book.members["w0"].waiting_for
        assert any("spare1 failed to start" in reason for _, reason in h.notes)
    asyncio.run(scenario())
