"""elastic_bsp on `ServerCore`, in one process (the harness of test_server_oracles): `r: 1` is BSP;
barriers hold every member of their round, ASP in between; the coordinator's ZipLine schedule is taken
only while it can still hold, else the fallback (a barrier after `r`) stays, so a silent coordinator
never blocks anyone; a departure releases a barrier, a joiner waits for the next round; every sample
is applied once through churn; a snapshot taken mid-round carries on identically."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from algorithms.policies.server import ServerCore
from core.schema import ElasticBSPConfig
from tests.unit.test_policy_oracles import ADAMW, SGD_M, max_diff, reference_bsp
from tests.unit.test_server_core import same
from tests.unit.test_server_oracles import CASES, COSTS, STEPS, Member, make_core, server_params, simulate


def barrier_updates(sim):
    return [u for r in sim.results for u in r.updates if u.barrier is not None]


@pytest.mark.parametrize("optimizer", [SGD_M, ADAMW], ids=["sgd_momentum", "adamw"])
@pytest.mark.parametrize("n,global_batch", CASES)
def test_r1_equals_bsp(n, global_batch, optimizer):
    sim = simulate(optimizer, ElasticBSPConfig(r=1), COSTS[:n], global_batch)
    sim.run()
    assert sim.core.version == STEPS and sim.core.staleness == {0: STEPS * n}
    assert [u.barrier for u in barrier_updates(sim)] == list(range(STEPS)), "every version is a barrier"
    diff = max_diff(server_params(sim), reference_bsp(optimizer, global_batch, STEPS))
    print(f"elastic_bsp r=1 n={n} B={global_batch} {optimizer['name']}: max |server - bsp| = {diff:.2e}")
    assert diff < 1e-5


def test_between_barriers_asp_at_a_barrier_everyone_of_the_round_once():
    """r = 4, w2 three times as slow: without a schedule every member syncs after 4 iterations; the
    fast ones' other pushes are applied alone; each barrier holds one push per member."""
    sim = simulate(SGD_M, ElasticBSPConfig(r=4), [1, 1, 3], 48, steps=40)
    sim.run()
    barriers = barrier_updates(sim)
    assert barriers and [u.barrier for u in barriers] == list(range(len(barriers)))
    assert all(len(u.tickets) == 3 and sorted(t.holder for t in u.tickets) == ["w0", "w1", "w2"] for u in barriers)
    singles = [u for r in sim.results for u in r.updates if u.barrier is None]
    assert all(len(u.tickets) == 1 for u in singles)
    within = [u for u in singles if u.tickets[0].clock < 4 * len(barriers)]
    assert len(within) == 3 * 3 * len(barriers), "3 lone pushes per member in each completed round"
    assert sim.core.schedules["fallback"] == len(barriers) + 1 and sim.core.schedules["zipline"] == 0
    clocks = [t.clock for u in barriers for t in u.tickets]
    assert clocks[:6] == [3, 3, 3, 7, 7, 7], "the barrier push is each member's 4th of the round"


def test_a_zipline_schedule_replaces_the_fallback_while_it_still_can():
    sim = simulate(SGD_M, ElasticBSPConfig(r=4), [1, 1, 3], 48, steps=60)
    core: ServerCore = sim.core
    assert core.set_schedule(0, {"w0": 3, "w1": 3, "w2": 1})
    assert core.round.at == {"w0": 2, "w1": 2, "w2": 0}
    sim.tick()  # w0 and w1 push once (w2 is still computing)
    assert not core.set_schedule(0, {"w0": 4, "w1": 4, "w2": 4}) and core.schedules["late"] == 1, "one schedule a round"
    sim.run(ticks=3)
    first = barrier_updates(sim)[0]
    assert {t.holder: t.clock for t in first.tickets} == {"w0": 2, "w1": 2, "w2": 0}
    # Round 1 began at clocks (3, 3, 1); w0 has already pushed clock 3, so a schedule naming it is late.
    sim.run(ticks=1)
    assert core.round.index == 1 and core.clocks["w0"] > core.round.began["w0"]
    assert not core.set_schedule(1, {"w0": 1, "w1": 1, "w2": 1}), "w0 already passed its first iteration"
    assert not core.set_schedule(0, {"w0": 4, "w1": 4, "w2": 4}), "an old round"
    assert not core.set_schedule(1, {"w0": 4, "w1": 4}), "not the round's members"
    assert not core.set_schedule(1, {"w0": 5, "w1": 4, "w2": 4}), "beyond r"
    assert core.set_schedule(1, {"w0": 4, "w1": 4, "w2": 2}) and core.round.at == {"w0": 6, "w1": 6, "w2": 2}


def test_a_departure_releases_the_barrier_and_a_joiner_waits_for_the_next_round():
    sim = simulate(SGD_M, ElasticBSPConfig(r=2), [1, 1, 5], 48, steps=200)
    core = sim.core
    sim.run(ticks=2)  # w0 and w1 sent their barrier pushes; w2 (5 ticks a step) has not
    assert set(core.round.staged) == {"w0", "w1"} and core.round.index == 0
    assert core.pull(sim.fence(sim.members["w0"])).status == "wait"
    sim.set_members([sim.members["w0"], sim.members["w1"]])  # w2 dies before the barrier
    [update] = sim.results[-1].updates
    assert update.barrier == 0 and {t.holder for t in update.tickets} == {"w0", "w1"}
    assert core.leases.counts["requeued"] == 16, "w2's unpushed share went back"
    joiner = Member("w3")
    sim.set_members([sim.members["w0"], sim.members["w1"], joiner])
    assert core.pull(sim.fence(joiner)).status == "wait", "a joiner waits for the next round"
    sim.run(ticks=2)
    assert core.round.index == 2 and set(core.round.at) == {"w0", "w1", "w3"}
    assert core.pull(sim.fence(joiner)).status == "ok"


@pytest.mark.parametrize("seed_costs", [[1, 2, 3], [3, 1, 1]])
def test_every_sample_of_a_data_epoch_is_applied_once_through_a_kill_and_a_join(seed_costs):
    """1797 samples, B = 48: 30 versions stay within one data epoch."""
    sim = simulate(SGD_M, ElasticBSPConfig(r=3), seed_costs, 48, steps=30)
    sim.run(ticks=6)
    survivors = [sim.members["w0"], sim.members["w2"]]
    sim.set_members(survivors)
    sim.run(ticks=6)
    sim.set_members(survivors + [Member("w1", 1, incarnation=1)])
    sim.run()
    sim.core.end()
    ids = [i for lease in sim.applied_leases() for i in lease.ids]
    counts = sim.core.leases.counts
    assert sim.core.version == 30 and len(ids) == len(set(ids)) == counts["applied"]
    assert counts["applied"] + counts["dropped"] + counts["requeued"] == counts["leased"], counts


def test_a_snapshot_mid_round_round_trips_and_carries_on_identically():
    sim = simulate(SGD_M, ElasticBSPConfig(r=3), [1, 2, 3], 48, steps=30)
    sim.run(ticks=4)
    assert sim.core.round.staged, "a barrier push is staged at the snapshot"
    buffer = io.BytesIO()
    torch.save(sim.core.state_dict(), buffer)  # as the server writes it; loads with weights_only
    buffer.seek(0)
    twin = copy.deepcopy(sim)
    twin.core, _, _, _ = make_core(SGD_M, ElasticBSPConfig(r=3), 48, steps=30)
    twin.core.load_state_dict(torch.load(buffer, weights_only=True))
    assert same(twin.core.state_dict(), sim.core.state_dict())
    sim.run()
    twin.run()
    assert sim.core.version == twin.core.version == 30
    assert torch.equal(sim.core.parameters(), twin.core.parameters())
