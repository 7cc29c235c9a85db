"""Membership decisions without Ray."""
from __future__ import annotations

from algorithms.rules.membership import (
    JoinerSource,
    MemberView,
    batch_for,
    choose_leavers,
    free_slots,
    joiner_source,
    placement_shortfall,
)


def test_newest_leave_first():
    members = [MemberView("w0", 0.1), MemberView("w3", 0.1), MemberView("w10", 0.1), MemberView("w2", 0.1)]
    assert choose_leavers(members, 2, "newest") == ["w10", "w3"]


def test_slowest_leave_first_ties_broken_by_newest():
    members = [MemberView("w0", 0.5), MemberView("w1", 0.2), MemberView("w2", 0.5), MemberView("w3", 0.1)]
    assert choose_leavers(members, 2, "slowest") == ["w2", "w0"]


def test_no_leavers_for_zero():
    assert choose_leavers([MemberView("w0", 0.0)], 0, "newest") == []


def test_free_slots_are_the_lowest_positions_not_taken_or_retired():
    assert free_slots(6, {"w0", "w2"}, {"w1"}, 2) == ["w3", "w4"]
    assert free_slots(3, {"w0"}, set(), 5) == ["w1", "w2"]
    assert free_slots(3, {"w0", "w1", "w2"}, set(), 1) == []


def test_batch_modes():
    assert batch_for(3, 32, 4, "keep_global") == (128, 1.0)
    assert batch_for(2, 32, 4, "keep_worker") == (64, 0.5)
    assert batch_for(6, 32, 4, "keep_worker") == (192, 1.5)


def test_a_slot_takes_a_ready_spare_else_waits_for_one_on_its_way_else_starts_a_new_actor():
    """A spare that is starting and that no other slot waits for is worth waiting for: it holds its room
    already (a new actor may find none) and its start is under way. Before, a slot with no ready spare
    always asked for a new actor."""
    assert joiner_source(ready_spares=1, starting_spares=0, waiting=3) is JoinerSource.SPARE
    assert joiner_source(ready_spares=0, starting_spares=1, waiting=0) is JoinerSource.NEXT_SPARE
    assert joiner_source(ready_spares=0, starting_spares=2, waiting=1) is JoinerSource.NEXT_SPARE
    assert joiner_source(ready_spares=0, starting_spares=1, waiting=1) is JoinerSource.NEW_ACTOR, "that one is taken"
    assert joiner_source(ready_spares=0, starting_spares=0, waiting=0) is JoinerSource.NEW_ACTOR


def test_a_placement_shortfall_names_what_one_worker_needs_and_what_is_free():
    assert placement_shortfall(1.0, 0.0, {"CPU": 0.5}) == "needs 1 CPUs, the cluster has 0.5 CPUs free"
    assert placement_shortfall(1.0, 1.0, {"CPU": 4.0}) == "needs 1 CPUs and 1 GPUs, the cluster has 4 CPUs and 0 GPUs free"
    assert placement_shortfall(1.0, 0.0, {"CPU": 1.0}) is None, "it fits: Ray is placing it"
