"""The server core's guarantees, in process without Ray: SSP's staleness bound under a straggler, a kill
and a join; exactly-once application of leases with kills, joins, stragglers, quorum drops and retried
pushes; fencing; snapshots that round-trip through `torch.save` / `torch.load(weights_only=True)`."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from algorithms.policies.server_messages import Fence, Push
from core.schema import ASPConfig, QuorumConfig, SSPConfig
from tests.unit.test_policy_oracles import ADAMW, SGD_M
from tests.unit.test_server_oracles import Member, Sim, make_core, simulate

SGD = {"name": "sgd", "lr": 0.05}


def ahead(sim: Sim, since: int = 0) -> int:
    """From the recorded pulls: how far the puller's clock was ahead of the slowest live member's."""
    return max(clock - min(clocks.values()) for _, clock, clocks in sim.pulls[since:])


def pulled_pair(policy, steps: int | None = None) -> tuple[Sim, Member, Member]:
    """Two members (global batch 16) that have both pulled their first ticket and not pushed yet."""
    sim = simulate(SGD, policy, [1, 1], 16, steps=steps)
    w0, w1 = sim.members.values()
    for member in (w0, w1):
        sim.pull(member)
    return sim, w0, w1


# ------------------------------------------------------------------ SSP's bound
def test_ssp_bound_holds_with_a_straggler_a_kill_and_a_join():
    s = 2
    sim = simulate(SGD, SSPConfig(s=s), [1, 1, 3], 24, steps=None)  # w2 is a 3x straggler
    sim.run(60)
    assert ahead(sim) == s, "the fast members run ahead, by s clocks and no more"
    assert sim.core.staleness.keys() <= set(range(s + 1))

    w0, w1, w2 = sim.members.values()
    mark, version = len(sim.pulls), sim.core.version
    sim.set_members([w0, w1])  # w2 is killed; its pending push never arrives
    sim.run(30)
    assert sim.core.version > version + 10, "clocks complete without the departed slot"
    assert "w2" not in sim.core.clocks and ahead(sim, mark) <= s

    slowest = min(m.clock for m in (w0, w1))
    mark = len(sim.pulls)
    sim.set_members([w0, w1, Member("w3", cost=3)])
    assert sim.core.clocks["w3"] == slowest, "a joiner starts at the minimum live clock"
    sim.run(60)
    assert ahead(sim, mark) == s and any(slot == "w3" for slot, _, _ in sim.pulls[mark:])


@pytest.mark.parametrize("s", [0, 2])
def test_ssp_goes_on_when_a_member_ahead_is_replaced_in_its_own_slot(s):
    """w1 pushes clocks the straggler w2 has not reached (they stay staged), dies, and a replacement
    takes slot w1 (incarnation 1, as a hot spare or Ray's restart does): clocks keep completing and
    the replacement's pushes are applied, never refused as the old incarnation's duplicates."""
    sim = simulate(SGD, SSPConfig(s=s), [1, 1, 4], 24, steps=None)
    while not any(p["lease"] in {t.leases[0].id for t in sim.core.leases.held("w1")}
                  for pushes in sim.core.staged.values() for p in pushes):
        sim.tick()  # until w1 has a push waiting for w2
    w0, _, w2 = sim.members.values()
    version = sim.core.version
    sim.set_members([w0, Member("w1", cost=1, incarnation=1), w2])
    sim.run(200)
    refused = sim.core.rejected["duplicate"]
    print(f"s={s}: version {version} -> {sim.core.version} in 200 ticks after the replacement; "
          f"{refused} pushes refused as duplicates")
    assert refused == 0 and sim.core.version >= version + 30


def test_quorum_never_waits_for_the_straggler_and_drops_its_late_pushes():
    sim = simulate(SGD, QuorumConfig(k=2), [1, 1, 3], 24, steps=None)
    sim.run(30)
    assert sim.core.version >= 25, "two fast members complete every clock"
    assert sim.core.rejected["dropped"] > 0 and sim.core.leases.counts["requeued"] > 0
    assert set(sim.core.staleness) == {0}, "a late member skips ahead: what is applied was never stale"


# ------------------------------------------------------------------ leases: exactly once
N_SAMPLES, BATCH = 240, 24


@pytest.mark.parametrize("policy", [SSPConfig(s=1), QuorumConfig(k=2), ASPConfig()], ids=["ssp1", "quorum2", "asp"])
def test_every_sample_of_a_data_epoch_is_applied_once(policy):
    """A 3x straggler (w2), a kill (w1, whose in-flight push arrives after its eviction), a join (w3),
    quorum drops and every push retried once: over data epoch 0, the applied samples, the open tickets
    and the requeue queue partition the epoch, and the counts add up."""
    sim = simulate(SGD, policy, [1, 1, 3], BATCH, steps=None, n_samples=N_SAMPLES)
    sim.retry = True
    sim.run(6)
    w0, w1, w2 = sim.members.values()
    if w1.pending is None:
        sim.pull(w1)
    evicted = w1.pending
    sim.set_members([w0, w2])
    assert sim.core.push(evicted).status == "not_member", "a push delayed past its eviction is refused"
    sim.run(6)
    sim.set_members([w0, w2, Member("w3")])
    while sim.core.leases.cursor < 2 * N_SAMPLES:
        sim.tick()

    leases = sim.core.leases
    applied = [i for lease in sim.applied_leases() if lease.data_epoch == 0 for i in lease.ids]
    assert len(applied) == len(set(applied)), "no sample is applied twice in a data epoch"
    open_ids = [i for t in leases.open.values() for lease in t.leases if lease.data_epoch == 0 for i in lease.ids]
    queued = [i for epoch, ids in leases.queue if epoch == 0 for i in ids]
    assert sorted(applied + open_ids + queued) == list(range(N_SAMPLES)), "every sample is in exactly one place"
    counts = leases.counts
    assert counts["applied"] == sum(len(lease.ids) for lease in sim.applied_leases())
    assert counts["applied"] + counts["dropped"] + counts["requeued"] + leases.outstanding == counts["leased"]
    assert counts["requeued"] > 0, "the kill requeued w1's ticket"
    assert all(t.holder in sim.core.members for t in leases.open.values()), "no lease is left with the departed"
    assert sim.core.rejected["duplicate"] > 0 and sim.core.rejected["not_member"] == 1
    if isinstance(policy, QuorumConfig):
        assert counts["dropped"] > 0 and sim.core.rejected["dropped"] > 0


def test_a_retried_push_is_applied_once():
    sim, w0, w1 = pulled_pair(SSPConfig(s=0))
    first = w0.pending
    assert sim.core.push(first).status == "staged"
    assert sim.core.push(first).status == "duplicate", "a retry while its clock waits"
    assert sim.core.push(w1.pending).status == "applied" and sim.core.version == 1
    assert sim.core.push(first).status == "duplicate", "a retry after its clock was applied"
    assert sim.core.version == 1 and sim.core.rejected["duplicate"] == 2
    assert sim.core.leases.counts["applied"] == 16


# ------------------------------------------------------------------ fencing
def test_pushes_from_a_replaced_worker_or_to_an_old_server_are_refused_and_counted():
    sim, w0, w1 = pulled_pair(SSPConfig(s=0))
    stale_w0 = w0.pending
    w0_new = Member("w0", incarnation=1)
    sim.set_members([w0_new, w1])
    assert sim.core.push(stale_w0).status == "fenced_worker"
    assert sim.core.pull(Fence(sim.epoch, "w0", 0, 0)).status == "fenced_worker"
    assert sim.core.leases.counts["requeued"] == 8, "the replaced incarnation's ticket was requeued"

    sim.core.new_incarnation()  # as after a restart from a snapshot
    assert sim.core.push(w1.pending).status == "fenced_server"
    assert sim.core.leases.counts["requeued"] == 16, "tickets issued by the old incarnation are requeued"
    ghost = Push(Fence(sim.epoch, "w9", 0, 1), (0,), 0, torch.zeros(1))
    assert sim.core.push(ghost).status == "not_member"
    assert {k: v for k, v in sim.core.rejected.items() if v} == {"fenced_worker": 1, "fenced_server": 1, "not_member": 1}

    for member in (w0_new, w1):
        sim.pull(member)
    assert w1.pending.fence.server_incarnation == 1
    assert sim.core.push(w0_new.pending).status == "staged" and sim.core.push(w1.pending).status == "applied"
    assert sim.core.leases.counts["applied"] == 16 and sim.core.version == 1


# ------------------------------------------------------------------ snapshots
def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("optimizer,policy", [(ADAMW, SSPConfig(s=2)), (SGD_M, QuorumConfig(k=2))], ids=["ssp_adamw", "quorum_sgd"])
def test_a_snapshot_round_trips_and_training_goes_on_identically(optimizer, policy):
    sim = simulate(optimizer, policy, [1, 1, 3], 24, shards=2, steps=None, n_samples=200)
    sim.run(17)
    assert sim.core.staged or isinstance(policy, QuorumConfig), "the snapshot holds staged pushes"
    buffer = io.BytesIO()
    torch.save(sim.core.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    twin = copy.deepcopy(sim)
    twin.core, _, _, _ = make_core(optimizer, policy, 24, shards=2, steps=None, n_samples=200)
    twin.core.load_state_dict(loaded)
    assert same(twin.core.state_dict(), sim.core.state_dict())
    for run in (sim, twin):
        run.run(40)
    assert torch.equal(sim.core.parameters(), twin.core.parameters())
    assert same(twin.core.state_dict(), sim.core.state_dict())


@pytest.mark.parametrize("optimizer", [SGD_M, ADAMW], ids=["sgd_momentum", "adamw"])
def test_a_snapshot_taken_before_a_concurrent_push_holds_its_own_version(optimizer):
    """The server takes `state_dict()` under its lock and serializes it outside, while pushes go on:
    what it serializes must be the state of the version it is labelled with, not a later push's
    momentum (or AdamW's step and moments) written into the same tensors meanwhile."""
    sim = simulate(optimizer, ASPConfig(), [1, 1], 16, steps=None)
    sim.run(6)
    reference = io.BytesIO()
    torch.save(sim.core.state_dict(), reference)  # serialized at once: the true state of this version
    taken = sim.core.state_dict()  # taken under the lock ...
    sim.run(3)  # ... pushes are applied while it is being written
    assert sim.core.version > taken["version"]
    late = io.BytesIO()
    torch.save(taken, late)
    for buf in (reference, late):
        buf.seek(0)
    expected, got = torch.load(reference, weights_only=True), torch.load(late, weights_only=True)
    assert same(got, expected), f"the snapshot labelled version {taken['version']} holds a later version's optimizer state"


def test_a_snapshot_does_not_fit_another_policy_or_shard_count():
    core, *_ = make_core(SGD, SSPConfig(s=1), 24, shards=2)
    other, *_ = make_core(SGD, SSPConfig(s=1), 24, shards=1)
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict(core.state_dict())


# ------------------------------------------------------------------ versions: staleness, schedule, the end
def test_staleness_is_the_version_at_apply_minus_the_version_pulled():
    sim, w0, w1 = pulled_pair(ASPConfig())
    assert sim.push(w0).updates[0].staleness == (0,)
    assert sim.push(w1).updates[0].staleness == (1,), "w1 pulled version 0 and was applied at version 1"
    assert sim.core.staleness == {0: 1, 1: 1}


def test_the_schedule_and_max_steps_count_versions():
    warm = {"name": "sgd", "lr": 0.2, "warmup_steps": 4}
    sim = simulate(warm, SSPConfig(s=0), [1, 2], 16, steps=6)
    sim.run()
    lrs = [u.lr for r in sim.results for u in r.updates]
    assert lrs == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.2, 0.2]) and sim.core.finished
    assert sim.core.pull(sim.fence(sim.members["w0"])).status == "finished"


def test_a_push_after_the_last_version_is_dropped_and_counted():
    sim, w0, w1 = pulled_pair(ASPConfig(), steps=1)
    assert sim.push(w0).status == "applied" and sim.core.finished
    assert sim.push(w1).status == "finished" and sim.core.version == 1
    assert sim.core.leases.counts == {"leased": 16, "applied": 8, "dropped": 8, "requeued": 0, "lost": 0}
    assert sim.core.rejected["finished"] == 1


def test_a_push_after_a_stop_counts_as_finished_not_stale():
    """A stop (a target reached, or asked) ends the server before `max_steps`: the open tickets are
    requeued, and a push that arrives afterwards is refused as `finished`."""
    sim, w0, w1 = pulled_pair(ASPConfig(), steps=10)
    assert sim.push(w0).status == "applied"
    sim.core.end()
    assert sim.push(w1).status == "finished" and sim.core.rejected["stale"] == 0
    assert sim.core.leases.counts == {"leased": 16, "applied": 8, "dropped": 0, "requeued": 8, "lost": 0}


def test_the_final_models_buffers_are_the_members_float_buffers_averaged_and_the_lowest_ranks_others():
    """Two members push their BatchNorm buffers (running mean, running var, batch count) with their
    gradients; the server keeps each one's newest and combines them for the final model."""
    from algorithms.policies.server_shards import combine_buffers

    sim = simulate(SGD, ASPConfig(), [1, 1], 16, steps=None)
    bn = torch.nn.BatchNorm1d(3)
    layout = list(bn.buffers())  # running_mean (3), running_var (3), num_batches_tracked ()
    sent = {"w0": [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 4.0, 4.0]), torch.tensor(7)],
            "w1": [torch.tensor([3.0, 2.0, 1.0]), torch.tensor([2.0, 0.0, 1.0]), torch.tensor(9)]}
    for m in sim.members.values():
        sim.pull(m)
        flat = torch.cat([b.reshape(-1).to(torch.float64) for b in sent[m.slot]])
        m.pending = Push(m.pending.fence, m.pending.lease_ids, m.pending.pulled_version, m.pending.grad, 0.0, flat)
        sim.push(m)
    mean, var, count = combine_buffers(sim.core.buffers(), layout)
    assert torch.equal(mean, torch.tensor([2.0, 2.0, 2.0])) and torch.equal(var, torch.tensor([3.0, 2.0, 2.5]))
    assert count.dtype == torch.int64 and int(count) == 7, "the batch count is the lowest-ranked member's"
    ghost = Push(Fence(sim.epoch, "w9", 0, 0), (0,), 0, torch.zeros(1), 0.0, torch.zeros(7, dtype=torch.float64))
    sim.core.push(ghost)
    assert set(sim.core.member_buffers) == {"w0", "w1"}, "a refused push's buffers are not kept"
    assert combine_buffers([], layout) is None
