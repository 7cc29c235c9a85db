"""The lease service on its own: clock c's leases are BSP's global batch c split by rank, leases never
span two data epochs, requeued samples keep their epoch and are dealt first, and outcomes add up."""
from __future__ import annotations

import pytest

from algorithms.rules.leases import LeaseService, share_bounds
from algorithms.rules.sampler import split_for_rank
from tests.unit.test_policy_oracles import SEED, global_batch_ids, share

HOLDERS = ["w0", "w1", "w2"]


def ids_of(ticket) -> list[int]:
    return [i for lease in ticket.leases for i in lease.ids]


@pytest.mark.parametrize("n_samples", [1437, 120], ids=["one_epoch", "batches_straddle_epochs"])
def test_clock_leases_are_bsp_global_batches_split_by_rank(n_samples):
    service = LeaseService(n_samples, SEED, 50)
    for clock in range(12):
        tickets = service.deal(clock, HOLDERS)
        batch = global_batch_ids(clock, 50, n_samples)
        assert [ids_of(t) for t in tickets] == [share(batch, rank, 3) for rank in range(3)]
        assert [t.rank for t in tickets] == [0, 1, 2] and [t.clock for t in tickets] == [clock] * 3
        for t in tickets:
            epochs = [lease.data_epoch for lease in t.leases]
            assert epochs == sorted(set(epochs)), "one lease per data epoch a share spans"
    assert any(len(t.leases) == 2 for t in service.open.values()) == (n_samples == 120)


def test_share_bounds_cut_as_the_bsp_split_does():
    for size, world in [(50, 3), (64, 4), (7, 7), (10, 4)]:
        positions = list(range(size))
        assert [positions[a:b] for a, b in share_bounds(size, world)] == [
            list(split_for_rank(positions, r, world)) for r in range(world)]


def test_requeued_samples_keep_their_epoch_and_are_dealt_first():
    service = LeaseService(120, SEED, 50)
    for clock in range(3):
        tickets = service.deal(clock, HOLDERS)
    straddling = tickets[1]
    service.close(straddling, "requeued")
    assert service.find(straddling.lease_ids) is None
    again = service.deal(3, HOLDERS)[0]
    assert ids_of(again)[:straddling.samples] == ids_of(straddling)
    assert [(lease.data_epoch, lease.ids) for lease in again.leases][:2] == [(lease.data_epoch, lease.ids) for lease in straddling.leases]
    assert min(lease.id for lease in again.leases) > max(straddling.lease_ids), "new lease ids"


def test_outcomes_add_up_and_applied_leases_are_remembered():
    service = LeaseService(200, SEED, 30)
    tickets = service.deal(0, HOLDERS)
    for ticket, outcome in zip(tickets, ("applied", "dropped", "requeued")):
        service.close(ticket, outcome)
    extra = service.deal_share(0, "w3", 3, 4)
    counts = service.counts
    assert counts == {"leased": 30 + extra.samples, "applied": 10, "dropped": 10, "requeued": 10, "lost": 0}
    assert service.outstanding == extra.samples and service.find(extra.lease_ids) == extra
    assert service.was_applied(tickets[0].lease_ids) and not service.was_applied(tickets[1].lease_ids)
    unapplied = ids_of(tickets[1]) + ids_of(tickets[2])  # dropped, then requeued: both back in the queue, in order
    assert ids_of(extra) == unapplied[:extra.samples] == ids_of(tickets[1])[:7]
    assert [i for _, ids in service.queue for i in ids] == unapplied[extra.samples:]


def test_clocks_are_dealt_in_order():
    service = LeaseService(100, SEED, 10)
    service.deal(0, HOLDERS)
    with pytest.raises(ValueError, match="out of order"):
        service.deal(2, HOLDERS)
    with pytest.raises(ValueError, match="cannot share"):
        service.deal(1, [f"w{i}" for i in range(11)])


def test_the_applied_set_stays_bounded_over_a_long_job_and_recent_retries_are_still_told_apart():
    """A week-long job applies millions of leases: the set that tells a retried push from a stale one
    must not keep every id forever (nor go whole into every snapshot under the server's lock)."""
    from algorithms.rules.leases import LeaseService

    bound = 40_000  # ids kept, whatever the job's length (here: 100000 leases closed)

    service = LeaseService(n_samples=1000, seed=0, global_batch=2)
    for clock in range(100_000):
        ticket = service.deal_share(clock, "w0", 0, 1)
        service.close(ticket, "requeued" if clock % 7 == 0 else "applied")
    snapshot = service.state_dict()
    print(f"applied ids kept after 100000 closes: {len(service.applied)} (snapshot {len(snapshot['applied'])})")
    assert len(service.applied) <= bound and len(snapshot["applied"]) <= bound
    recent_applied, recent_requeued = service.next_id - 1, service.next_id - 5  # one lease a ticket: clock 99999 applied, 99995 requeued
    assert service.was_applied((recent_applied,)) and not service.was_applied((recent_requeued,))
    twin = LeaseService(n_samples=1000, seed=0, global_batch=2)
    twin.load_state_dict(snapshot)
    assert twin.was_applied((recent_applied,)) and twin.was_applied((0,)), "ids below the kept window count as closed"
