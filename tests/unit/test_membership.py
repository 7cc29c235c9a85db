"""Membership decisions without Ray."""
from __future__ import annotations

from algorithms.rules.membership import MemberView, batch_for, choose_leavers, free_slots


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
