"""The supervisor (actors/control/supervisor.py) and the batches its outcomes are taken in (actors/control/outcomes.py):
detectors and decisions, over a fake worker group and a recording stand-in for the coordinator shell's `Actions`. No Ray."""
from __future__ import annotations

import asyncio
import time

from actors.control.book import MembershipBook
from actors.control.members import Member
from actors.control.supervisor import STRAGGLER_WARMUP_STEPS, Supervisor
from actors.messages import Heartbeat, RunOutcome
from actors.plan import WorkerSpec
from algorithms.rules.kinds import SYNCHRONOUS
from algorithms.rules.supervision import JobState, MemberState
from core.schema import JobConfig, parse
from orchestrator.config import config_from_dict
from testkit.fake_workers import FakeWorkerGroup

S = MemberState


class Recorder:
    """What the supervisor asks of the coordinator (`Actions`), recorded."""

    def __init__(self, book: MembershipBook) -> None:
        self.book, self.state, self.stop_kind, self.cause = book, JobState.RUNNING, None, None
        self.calls: list[tuple] = []
        self.plan_aborts: list[bool] = []
        """Per reshape: whether its plan carries the abort of the epoch (`Plan.aborts_epoch`)."""

    def view(self):
        return self.book.view(self.state, self.stop_kind, None)

    def transition(self, to, reason):
        self.calls.append(("transition", to))
        self.state = to

    def set_cause(self, cause):
        self.cause = cause

    def reshape(self, members, reason, detector, detected_at, new_epoch=False, aborts=False):
        self.calls.append(("reshape", members, detector))
        self.plan_aborts.append(aborts)

    def publish(self, members, reason):
        self.calls.append(("publish", members))

    def reform(self, reason):
        self.calls.append(("reform", reason))

    def abort_epoch(self, reason):
        self.calls.append(("abort",))

    def begin_stop(self, kind, cause, stop_step):
        self.stop_kind = kind
        self.calls.append(("stop", kind, stop_step))

    def restore_on_admit(self):
        self.calls.append(("restore",))

    def replace(self, slot):
        self.calls.append(("replace", slot))

    async def slot_failed(self, member, phase, cause):
        return False

    async def departure_settled(self):
        self.calls.append(("settled",))

    async def end(self, state, reason, detail=None, quiet=False):
        self.calls.append(("end", state))

    async def stop_now(self, kind, state, reason):
        self.stop_kind = kind
        self.calls.append(("end", state))

    async def finish(self):
        self.calls.append(("finish",))


def harness(n: int = 4, **workers):
    cfg = parse(JobConfig, config_from_dict({
        "name": "s", "workers": {"count": n, "min": 2, "heartbeat_s": 0.2, **workers},
        "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8},
        "stop": {"max_steps": 10}}).to_dict())
    group = FakeWorkerGroup()
    book = MembershipBook(cfg, "r", SYNCHRONOUS)
    for i in range(n):
        handle = group.create(f"s/r/w{i}", WorkerSpec("s", "r", f"w{i}", "/tmp", "s", "ns", {}, ()))
        group.run(handle)
        book.members[f"w{i}"] = Member(f"w{i}", handle, state=S.TRAINING)
    book.next_plan(tuple(book.members), "start", incarnation=0, store_host="h", store_port=0, history_step=0)
    actions = Recorder(book)
    notes: list[tuple[str, str, dict]] = []
    sup = Supervisor(cfg, book, group, actions, lambda kind, reason, **d: notes.append((kind, reason, d)), SYNCHRONOUS,
                     lambda: 7)
    return sup, group, book, actions, notes


def test_deaths_that_come_together_re_form_the_survivors_once():
    async def scenario():
        sup, group, book, actions, notes = harness(6)
        sup.start()
        for m in book.members.values():
            sup.watch(m)
        for slot in ("w1", "w3", "w4"):
            group.die(slot)
            await asyncio.sleep(0.002)
        batch = await sup.outcomes.next(1.0)
        assert len(batch) == 3, "outcomes a few ms apart are one batch"
        await sup.handle(batch)
        reshapes = [c for c in actions.calls if c[0] == "reshape"]
        assert reshapes == [("reshape", ("w0", "w2", "w5"), "actor death")], actions.calls
        assert actions.plan_aborts == [True] and ("abort",) not in actions.calls, \
            "the epoch's abort goes out once, in the survivors' plan, not as a call of its own before it"
        assert [c[1] for c in actions.calls if c[0] == "replace"] == ["w1", "w3", "w4"]
        assert [d["slot"] for k, _, d in notes if k == "failure"] == ["w1", "w3", "w4"]
    asyncio.run(scenario())


def test_a_later_death_that_pauses_the_job_drops_the_batchs_re_form():
    async def scenario():
        sup, group, book, actions, _ = harness(4, min=3)
        sup.start()
        for m in book.members.values():
            sup.watch(m)
        group.die("w1")
        group.die("w2")
        await sup.handle(await sup.outcomes.next(1.0))
        assert not [c for c in actions.calls if c[0] == "reshape"], "below workers.min: no plan, PAUSED"
        assert ("transition", JobState.PAUSED) in actions.calls
        assert actions.calls.count(("abort",)) == 1, "no plan carries the epoch's abort: it goes out on its own"
    asyncio.run(scenario())


async def first_batch_of_heartbeats(sup):
    """The first outcomes the heartbeat loop gives (within 3 s); the loop is stopped after."""
    beats = asyncio.get_running_loop().create_task(sup.heartbeats())
    batch = await sup.outcomes.next(3.0)
    beats.cancel()
    return batch


def test_a_member_that_does_not_answer_heartbeats_is_evicted_as_hung():
    async def scenario():
        sup, group, book, actions, notes = harness()
        sup.start()
        group.hang("w2")
        batch = await first_batch_of_heartbeats(sup)
        assert [m.slot for m, *_ in batch] == ["w2"]
        await sup.handle(batch)
        assert book.members["w2"].state == S.HUNG and not group.current("w2").alive
        assert notes[0][2]["detector"] == "heartbeat"
    asyncio.run(scenario())


def test_a_member_whose_step_computes_past_the_hang_timeout_is_evicted_by_step_progress():
    """Its heartbeats are answered (the process runs) but its step never ends: only the step-progress
    detector can see it. The others, computing a step just begun, stay."""
    async def scenario():
        sup, group, book, actions, notes = harness(hang_timeout_s=0.5)
        sup.start()
        now = time.monotonic()
        for slot, began in (("w0", now), ("w1", now), ("w2", now - 5.0), ("w3", now)):
            worker = group.current(slot)
            worker.phase, worker.phase_since, worker.step = "compute", began, 15
        batch = await first_batch_of_heartbeats(sup)
        assert [m.slot for m, *_ in batch] == ["w2"]
        await sup.handle(batch)
        assert book.members["w2"].state == S.HUNG and not group.current("w2").alive
        assert notes[0][2]["detector"] == "step progress"
        assert "w2's step 15 has been computing for" in notes[0][1], notes[0]
        assert all(book.members[s].state == S.TRAINING for s in ("w0", "w1", "w3"))
    asyncio.run(scenario())


def test_each_member_is_sent_one_heartbeat_a_period_whatever_the_group_size(monkeypatch):
    """The heartbeats go out in slices spread over the period (`HEARTBEAT_SLICES`), and each member gets one
    a period (`min(1, heartbeat_s / 4)`). Written from that rule, on a virtual clock: the supervisor's
    sleeps advance it and nothing waits in real time. (With fewer members than slices, each member was sent
    one every slice: 8 a second to each of 2 workers, instead of 1.)"""
    import actors.control.supervisor as supervisor_module

    real_sleep = asyncio.sleep

    async def scenario(n: int) -> list[int]:
        sup, _, book, actions, _ = harness(n, min=1, heartbeat_s=4.0)  # a period of 1 s
        clock = [0.0]
        beats = {slot: 0 for slot in book.members}
        periods = 6

        async def virtual_sleep(seconds: float) -> None:
            clock[0] += seconds
            if clock[0] >= periods - 1e-9:
                actions.state = JobState.FINISHED
            await real_sleep(0)

        async def heartbeat(handle, timeout):
            beats[next(slot for slot, m in book.members.items() if m.handle is handle)] += 1
            return Heartbeat(1, "computing", 0.0)

        monkeypatch.setattr(supervisor_module.asyncio, "sleep", virtual_sleep)
        monkeypatch.setattr(sup.group, "heartbeat", heartbeat)
        try:
            await sup.heartbeats()
            await real_sleep(0)
        finally:
            monkeypatch.setattr(supervisor_module.asyncio, "sleep", real_sleep)
        return list(beats.values())

    for n in (1, 2, 5, 16, 20, 40):
        counts = asyncio.run(scenario(n))
        assert all(5 <= c <= 6 for c in counts), (n, counts)


def test_a_failed_collective_with_everyone_answering_re_forms_and_a_silent_member_is_evicted():
    async def scenario():
        sup, group, book, actions, _ = harness()
        sup.start()
        await sup.collective_failed("w0", book.epoch, "connection reset")
        assert actions.calls == [("reform", "w0's collective failed with every member alive: connection reset")]
        group.hang("w3")
        await sup.collective_failed("w0", book.epoch, "timeout")
        assert book.members["w3"].evicted[0] == "collective failure"
        assert await sup.outcomes.next(0.1), "the eviction is an outcome"
        await sup.collective_failed("w0", book.epoch - 1, "late")  # an older epoch's failure: nothing
        assert len([c for c in actions.calls if c[0] == "reform"]) == 1
    asyncio.run(scenario())


def test_a_member_whose_process_is_exiting_is_evicted_at_the_first_failed_collective():
    """A killed worker's peers hear of it when its sockets close, and Ray later still; its process was
    flagged exiting long before. The first failed collective's report finds it so on this node, and its
    death is an outcome at once, not once the probe has waited out its silence (detector `collective
    failure`, PROBE_S later)."""
    async def scenario():
        sup, group, book, actions, _ = harness()
        sup.start()
        for member in book.members.values():
            member.pid = group.current(member.slot).pid
        victim = book.members["w2"]
        group.hang("w2")  # dying: it answers nothing, and Ray has not said it died
        group.processes[victim.pid] = "exiting"
        probing = asyncio.get_running_loop().create_task(
            sup.collective_failed("w0", book.epoch, "Connection closed by peer"))
        batch = await sup.outcomes.next(30.0)
        assert [m.slot for m, *_ in batch] == ["w2"], batch
        assert victim.evicted is not None and victim.evicted[0] == "actor death" and "exiting" in victim.evicted[1]
        assert group.processes_killed == [] and group.kills == 0, "exiting already: no kill before its outcome is handled"
        await probing
        assert [c for c in actions.calls if c[0] == "reform"] == [], "a member died: no re-form of the same members"
        await sup.handle(batch)
        for _ in range(100):  # the kill waits for the survivors' first commit without w2 (a task)
            if group.kills:
                break
            await asyncio.sleep(0.01)
        assert group.kills == 1 and not group.current("w2").alive, "its actor killed once the survivors committed"
    asyncio.run(scenario())


def test_stop_while_paused_stops_at_the_held_step_and_a_running_stop_at_the_next(monkeypatch):
    async def scenario():
        sup, _, _, actions, _ = harness()
        actions.state = JobState.PAUSED
        await sup.stop("STOPPED", "asked")
        assert ("stop", "STOPPED", 0) in actions.calls and ("publish", ("w0", "w1", "w2", "w3")) in actions.calls
        sup, _, _, actions, _ = harness()
        await sup.stop("STOPPED", "asked")
        assert ("stop", "STOPPED", 8) in actions.calls, "the step after the committed step 7"
    asyncio.run(scenario())


def test_stragglers_are_named_after_their_warm_up_at_most_every_half_second(monkeypatch):
    sup, _, book, _, notes = harness()
    clock = [1000.0]
    monkeypatch.setattr("actors.control.supervisor.time.time", lambda: clock[0])
    for slot in ("w0", "w1", "w2"):
        sup.progress(book.members[slot], STRAGGLER_WARMUP_STEPS, 0.1)
    sup.progress(book.members["w3"], STRAGGLER_WARMUP_STEPS - 1, 0.5)
    assert not [n for n in notes if n[0] == "straggler"], "not during its warm-up"
    sup.progress(book.members["w3"], STRAGGLER_WARMUP_STEPS, 0.5)
    assert not [n for n in notes if n[0] == "straggler"], "not again within half a second"
    clock[0] += 0.5
    sup.progress(book.members["w3"], STRAGGLER_WARMUP_STEPS + 1, 0.5)
    assert [n[2]["slot"] for n in notes if n[0] == "straggler"] == ["w3"]


def test_a_second_outcome_of_the_same_member_does_not_hold_the_batch_open(monkeypatch):
    """A death found twice (Ray's notice through the member's watch, then a probe's eviction) waits one
    quiet period after the first, not a second one after the duplicate. With QUIET_S at 2 s (GATHER_MAX_S
    10 s) and the duplicate 1.5 s in, the batch closes near 2 s; a duplicate that reopened the window would close it
    near 3.5 s. (A new member's end still extends it: test_deaths_that_come_together_re_form_the_survivors_once.)"""
    monkeypatch.setattr("actors.control.outcomes.QUIET_S", 2.0)
    monkeypatch.setattr("actors.control.outcomes.GATHER_MAX_S", 10.0)

    async def scenario():
        sup, group, book, _, _ = harness(3)
        sup.start()
        member = book.members["w1"]
        loop = asyncio.get_running_loop()
        started = loop.time()
        await sup.outcomes.put((member, "died", RunOutcome(False, error="watch"), 0.0))
        loop.call_later(1.5, sup.outcomes.queue.put_nowait, (member, "died", RunOutcome(False, error="probe"), 0.0))
        batch = await sup.outcomes.next(1.0)
        took = loop.time() - started
        assert [o[2].error for o in batch] == ["watch", "probe"]
        assert took < 3.0, f"the duplicate held the batch open: {took:.2f}s"
    asyncio.run(scenario())


def test_a_deaths_batch_closes_once_every_survivor_has_said_it_is_alive(monkeypatch):
    """The batch's quiet window gathers members that end together. Once every other member of the epoch
    has reported a failed collective (a survivor of a death does), none of them is still to end, and the
    batch closes at once. With QUIET_S at 2 s: the survivors' reports at 0.1-0.2 s close it near 0.2 s;
    without them (or with the early close switched off) it waits the full 2 s. A member that has not
    reported keeps it open, so a second death at 0.5 s joins the first's batch."""
    monkeypatch.setattr("actors.control.outcomes.QUIET_S", 2.0)
    monkeypatch.setattr("actors.control.outcomes.GATHER_MAX_S", 10.0)

    async def closes(reporters: tuple[str, ...], dies_later: str | None = None) -> tuple[float, list[str]]:
        sup, group, book, _, _ = harness(3)
        sup.start()
        for m in book.members.values():
            sup.watch(m)
        loop = asyncio.get_running_loop()
        started = loop.time()
        group.die("w1")
        for i, slot in enumerate(reporters):
            loop.call_later(0.1 * (i + 1), lambda s=slot: loop.create_task(
                sup.collective_failed(s, book.epoch, "Connection closed by peer")))
        if dies_later:
            loop.call_later(0.5, group.die, dies_later)
        batch = await sup.outcomes.next(1.0)
        return loop.time() - started, sorted({m.slot for m, *_ in batch})

    took, ended = asyncio.run(closes(("w0", "w2")))
    assert took < 1.0 and ended == ["w1"], f"every survivor reported: closed after {took:.2f}s"
    took, ended = asyncio.run(closes(()))
    assert took > 1.9 and ended == ["w1"], f"no reports: the full window, {took:.2f}s"
    took, ended = asyncio.run(closes(("w0",), dies_later="w2"))
    assert ended == ["w1", "w2"], "w2 never said it was alive: its death 0.5 s later is the same batch"


def test_a_deaths_batch_closes_at_once_when_the_other_members_processes_run_on_this_node(monkeypatch):
    """Where the others run on the coordinator's node, their processes say whether they are ending too:
    the kernel flags a killed process as exiting within a millisecond, long before anyone hears of its
    death. Every other process running: the batch closes at once, without the survivors' reports (on
    a small machine they come no sooner than Ray's notice). One of them exiting: the batch waits for it.
    With QUIET_S at 2 s; switched off, every case waits the full 2 s."""
    monkeypatch.setattr("actors.control.outcomes.QUIET_S", 2.0)
    monkeypatch.setattr("actors.control.outcomes.GATHER_MAX_S", 10.0)

    async def closes(exiting: str | None) -> tuple[float, list[str]]:
        sup, group, book, _, _ = harness(3)
        sup.start()
        for m in book.members.values():
            m.pid = group.current(m.slot).pid
            group.processes[m.pid] = "running"
            sup.watch(m)
        if exiting:
            group.processes[book.members[exiting].pid] = "exiting"
            asyncio.get_running_loop().call_later(0.5, group.die, exiting)
        loop = asyncio.get_running_loop()
        started = loop.time()
        group.die("w1")
        batch = await sup.outcomes.next(1.0)
        return loop.time() - started, sorted({m.slot for m, *_ in batch})

    took, ended = asyncio.run(closes(None))
    assert took < 1.0 and ended == ["w1"], f"the others' processes run: closed after {took:.2f}s"
    took, ended = asyncio.run(closes("w2"))
    assert ended == ["w1", "w2"], "w2's process was exiting: its death 0.5 s later is the same batch"


def test_a_member_whose_lifeline_ends_is_evicted_before_anyone_hears_of_its_death():
    """A member on the coordinator's node holds a lifeline (actors/lifeline.py): its watcher wakes as the
    kill lands, long before Ray's notice or the survivors' failed collectives. That wake alone, from
    the watcher's own thread, makes the death an outcome: nothing else here says the member died, and
    /proc need not show the process exiting yet. An end the coordinator caused (the member evicted
    already) is not a death. Switched off (no `watch_exit` in `watch`), the batch never comes."""
    async def scenario():
        sup, group, book, actions, notes = harness()
        sup.start()
        for member in book.members.values():
            member.pid, member.lifeline = group.current(member.slot).pid, {"fd": 3, "token": "00"}
            group.processes[member.pid] = "running"
            sup.watch(member)
        assert set(group.exit_watches) == {m.pid for m in book.members.values()}, "each member's lifeline watched"
        victim = book.members["w2"]
        group.exit_begins("w2").join()
        batch = await sup.outcomes.next(10.0)
        assert [m.slot for m, *_ in batch] == ["w2"], batch
        assert victim.evicted == ("actor death", "worker w2's process is exiting (its lifeline ended)")
        kill = group.kill
        group.kill = lambda handle: (actions.calls.append(("kill", handle.name)), kill(handle))  # type: ignore[method-assign]
        await sup.handle(batch)
        for _ in range(100):  # the kill waits for the survivors' first commit without w2 (a task)
            if ("kill", "s/r/w2") in actions.calls:
                break
            await asyncio.sleep(0.01)
        assert [c for c in actions.calls if c[0] == "reshape"] == [("reshape", ("w0", "w1", "w3"), "actor death")]
        order = [c[0] for c in actions.calls if c[0] in ("abort", "reshape", "settled", "kill")]
        assert order == ["reshape", "settled", "kill"], \
            f"the survivors' plan, then their first commit without it, then the dead actor's kill: {order}"
        assert actions.plan_aborts == [True], "the plan carries the epoch's abort"

        on_end, wanted = group.exit_watches[victim.pid]
        assert not wanted(), "an evicted member's watcher stops"
        on_end()  # a second wake (or one for an eviction the coordinator made): nothing more
        await asyncio.sleep(0.05)
        queued = [sup.outcomes.queue.get_nowait()[0].slot for _ in range(sup.outcomes.queue.qsize())]
        assert set(queued) <= {"w2"}, queued  # w2's watch: the kill it was sent
        assert group.processes_killed == [], "a process seen exiting is not sent a SIGKILL"

        # A SIGKILL ends the threads one by one: the holder's end may come before the main thread's flag.
        other = book.members["w1"]
        group.exit_watches[other.pid][0]()
        batch = await sup.outcomes.next(10.0)
        assert [m.slot for m, *_ in batch] == ["w1"] and other.evicted is not None, batch
        assert group.processes_killed == [("", other.pid)], "not yet seen exiting: its SIGKILL is sent too"
    asyncio.run(scenario())


def test_a_batch_wait_cancelled_leaves_no_waiter_behind(monkeypatch):
    """The main task cancelled while a batch's window is open (its event loop closing, a test playing the
    coordinator's death): the window's two waiters, on the next outcome and on a survivor's report, end
    with it instead of waiting on the loop for ever."""
    monkeypatch.setattr("actors.control.outcomes.QUIET_S", 30.0)
    monkeypatch.setattr("actors.control.outcomes.GATHER_MAX_S", 30.0)

    def waiters() -> list[str]:
        return [t.get_coro().__qualname__ for t in asyncio.all_tasks()
                if not t.done() and t.get_coro().__qualname__ in ("Queue.get", "Event.wait")]

    async def scenario():
        sup, _, book, _, _ = harness(3)
        sup.start()
        await sup.outcomes.put((book.members["w1"], "died", RunOutcome(False, error="SIGKILL"), 0.0))
        batch = asyncio.ensure_future(sup.outcomes.next(1.0))
        while len(waiters()) < 2:  # the first outcome taken, the window open
            await asyncio.sleep(0)
        batch.cancel()
        await asyncio.wait([batch])
        await asyncio.sleep(0)  # the waiters' cancellation lands
        assert not waiters(), f"left waiting: {waiters()}"
    asyncio.run(scenario())
