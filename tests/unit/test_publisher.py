"""The publisher (actors/control/publisher.py): plans handed out, the server told first, epochs
aborted once. Over a fake worker group: no Ray."""
from __future__ import annotations

from actors.control.book import MembershipBook
from actors.control.members import Member
from actors.control.publisher import Publisher
from actors.plan import WorkerSpec
from algorithms.rules.kinds import DECENTRALIZED, SYNCHRONOUS, Kind
from algorithms.rules.supervision import MemberState
from core.schema import JobConfig, parse
from orchestrator.config import config_from_dict
from testkit.fake_workers import FakeWorkerGroup

S = MemberState


class Server:
    def __init__(self, log: list) -> None:
        self.log = log

    def set_members(self, epoch, members) -> None:
        self.log.append(("server", epoch, tuple(s for s, _ in members)))


class Harness:
    def __init__(self, kind: Kind = SYNCHRONOUS, server: bool = False) -> None:
        cfg = parse(JobConfig, config_from_dict({
            "name": "job", "workers": {"count": 3, "max": 4},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8},
            "sync": {"policy": "dpsgd" if kind is DECENTRALIZED else "bsp"}, "stop": {"max_steps": 10}}).to_dict())
        self.group = FakeWorkerGroup()
        self.book = MembershipBook(cfg, "r", kind)
        self.log: list = []
        self.saves = 0
        self.server = Server(self.log) if server else None
        for i in range(3):
            slot = f"w{i}"
            handle = self.group.create(f"job/r/{slot}", WorkerSpec("job", "r", slot, "/tmp", "job", "ns", {}, ()))
            self.book.members[slot] = Member(slot, handle, node=f"10.0.0.{i}", store_port=7000 + i, state=S.TRAINING,
                                             incarnation=i + 1)
        set_plan, abort_epoch = self.group.set_plan, self.group.abort_epoch

        def sent_plan(handle, plan):
            self.log.append(("set_plan", handle.slot, plan.version))
            return set_plan(handle, plan)

        def sent_abort(handle, epoch, reason):
            self.log.append(("abort_epoch", handle.slot, epoch))
            return abort_epoch(handle, epoch, reason)
        self.group.set_plan, self.group.abort_epoch = sent_plan, sent_abort  # type: ignore[method-assign]
        self.publisher = Publisher(self.book, self.group, kind, 0, lambda: self.server, self.save,
                                   lambda version, sent: None)

    def save(self) -> int:
        self.saves += 1
        return self.saves


def test_a_plan_reaches_every_reachable_member_after_the_server_and_is_saved():
    h = Harness(server=True)
    h.book.members["w2"].state = S.DEAD
    plan = h.publisher.publish(("w0", "w1"), "w2 died", history_step=7)
    assert plan.members == ("w0", "w1") and plan.history_step == 7 and plan.membership_epoch == 1
    assert h.log[0] == ("server", 1, ("w0", "w1")), "the server admits a membership before its members pull under it"
    assert sorted(h.log[1:]) == [("set_plan", "w0", 1), ("set_plan", "w1", 1)], "not to the dead member"
    assert h.saves == 1
    assert (plan.store_host, plan.store_port) == ("10.0.0.0", 7000), "the epoch rendezvous on its rank 0's store"
    again = h.publisher.publish(("w0", "w1"), "stop", history_step=7)
    assert again.membership_epoch == 1 and (again.store_host, again.store_port) == ("10.0.0.0", 7000)


def test_each_epoch_names_the_store_of_its_rank_0_and_skips_a_member_that_serves_none():
    """Every worker serves a group store of its own (actors/training/worker.py `HostedStore`); a plan names its
    rank 0's, so the coordinator serves none. A member that reported no store (port 0) is passed over."""
    h = Harness()
    first = h.publisher.publish(("w1", "w2", "w0"), "start", history_step=0)
    assert (first.store_host, first.store_port) == ("10.0.0.1", 7001)
    h.book.members["w1"].state = S.DEAD
    second = h.publisher.publish(("w2", "w0"), "w1 died", history_step=3)
    assert second.membership_epoch == 2 and (second.store_host, second.store_port) == ("10.0.0.2", 7002)
    h.book.members["w2"].store_port = 0
    third = h.publisher.publish(("w2", "w0"), "re-form", history_step=3, new_epoch=True)
    assert (third.store_host, third.store_port) == ("10.0.0.0", 7000)


def test_an_epoch_is_aborted_once_however_many_ask():
    h = Harness()
    h.publisher.publish(("w0", "w1", "w2"), "start", history_step=0)
    h.log.clear()
    for reason in ("w0 died", "w1 died", "probe: w0 gone"):
        h.publisher.abort_epoch(reason)
    assert [entry for entry in h.log if entry[0] == "abort_epoch"] == [("abort_epoch", s, 1) for s in ("w0", "w1", "w2")]
    h.publisher.publish(("w1", "w2"), "re-form", history_step=0)
    h.log.clear()
    h.publisher.abort_epoch("w1 died")
    assert [entry for entry in h.log if entry[0] == "abort_epoch"] == [("abort_epoch", s, 2) for s in ("w0", "w1", "w2")], \
        "a new epoch is aborted again"


def test_gossip_members_are_told_to_leave_the_previous_epoch_with_each_new_plan():
    h = Harness(kind=DECENTRALIZED)
    h.publisher.publish(("w0", "w1", "w2"), "start", history_step=0)
    assert not [entry for entry in h.log if entry[0] == "abort_epoch"], "the first plan has no previous epoch"
    h.publisher.publish(("w0", "w1", "w2"), "again", history_step=0)
    aborts = [entry for entry in h.log if entry[0] == "abort_epoch"]
    assert aborts == [("abort_epoch", s, 1) for s in ("w0", "w1", "w2")], aborts
    set_plans = [i for i, entry in enumerate(h.log) if entry[0] == "set_plan" and entry[2] == 2]
    assert max(set_plans) < min(i for i, entry in enumerate(h.log) if entry[0] == "abort_epoch"), \
        "the new plan goes out before the old epoch is aborted"


def test_a_plan_that_aborts_the_epoch_carries_the_abort_once_and_only_in_the_copies_sent():
    """The survivors' plan after a death aborts the epoch it ends (`Plan.aborts_epoch`): one call to
    each member instead of an abort and then a plan. Once an epoch is aborted, neither a second plan
    nor `abort_epoch` aborts it again; the book's own plan does not carry it."""
    h = Harness()
    h.publisher.publish(("w0", "w1", "w2"), "start", history_step=0)
    h.log.clear()
    plan = h.publisher.publish(("w0", "w1"), "w2 died", history_step=0, aborts=True)
    sent = [handle.plans[-1] for handle in (h.group.current(s) for s in ("w0", "w1", "w2"))]
    assert {p.aborts_epoch for p in sent} == {1} and {p.version for p in sent} == {plan.version}, sent
    assert plan.aborts_epoch is None and h.book.plan.aborts_epoch is None, "the book's plan aborts nothing"
    assert not [entry for entry in h.log if entry[0] == "abort_epoch"], "no call of its own"
    assert [h.group.current(s).aborted for s in ("w0", "w1")] == [[1], [1]]
    h.publisher.abort_epoch("a probe finds w2 gone")  # epoch 2 is not aborted: this one is
    assert [entry[2] for entry in h.log if entry[0] == "abort_epoch"] == [2, 2, 2]
    h.log.clear()
    again = h.publisher.publish(("w0",), "w1 died", history_step=0, aborts=True)
    assert h.group.current("w0").plans[-1].aborts_epoch is None and again.membership_epoch == 3, \
        "epoch 2 was aborted already: once per epoch"
