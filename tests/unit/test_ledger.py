"""The committed-step ledger: every step reaches history exactly once, and a step that only
departed members applied (a split last vote) is dropped and redone, never written."""
from __future__ import annotations

from actors.control.ledger import CommittedLedger


def rec(step: int, epoch: int = 1, loss: float = 0.0) -> dict:
    return {"step": step, "membership_epoch": epoch, "loss": loss}


def steps(records: list[dict]) -> list[int]:
    return [r["step"] for r in records]


def test_next_step_confirms_the_previous_one():
    ledger = CommittedLedger()
    assert ledger.offer(rec(1)) == []
    assert steps(ledger.offer(rec(2))) == [1]
    assert steps(ledger.offer(rec(3))) == [2]
    assert ledger.newest_step == 3 and ledger.written_step == 2
    assert steps(ledger.close()) == [3] and ledger.written_step == 3


def test_duplicates_and_stale_reports_are_ignored():
    ledger = CommittedLedger()
    ledger.offer(rec(1))
    ledger.offer(rec(2))
    assert ledger.offer(rec(1)) == [] and ledger.offer(rec(2)) == []
    assert ledger.tentative["step"] == 2


def test_agreement_on_a_lower_step_drops_the_tentative_record():
    """Rank 0 committed step 5 alone and died; the survivors agree on 4 and redo 5."""
    ledger = CommittedLedger()
    for s in range(1, 6):
        ledger.offer(rec(s, epoch=1, loss=float(s)))
    assert ledger.agreed(2, 4) == []
    assert [d["step"] for d in ledger.dropped] == [5] and ledger.written_step == 4
    assert ledger.offer(rec(5, epoch=2, loss=50.0)) == []
    written = ledger.offer(rec(6, epoch=2))
    assert steps(written) == [5] and written[0]["loss"] == 50.0 and written[0]["membership_epoch"] == 2


def test_records_offered_before_an_agreement_fill_what_rank_0_never_reported():
    """Rank 0 died with steps 28..31 unreported (or failed its last vote while the others committed
    32): the new rank 0 offers its own records since the plan's history step, then agrees."""
    ledger = CommittedLedger()
    for s in range(1, 28):
        ledger.offer(rec(s, epoch=1))
    written = []
    for s in range(25, 33):  # from the plan's history_step on: duplicates are harmless
        written += ledger.offer(rec(s, epoch=1, loss=float(s)))
    written += ledger.agreed(2, 32)
    assert steps(written) == list(range(27, 33)) and written[-1]["loss"] == 32.0
    assert ledger.tentative is None and ledger.written_step == 32
    assert ledger.offer(rec(32, epoch=1)) == []
    assert ledger.offer(rec(33, epoch=2)) == [] and steps(ledger.close()) == [33]


def test_agreement_on_the_tentative_step_confirms_it():
    ledger = CommittedLedger()
    ledger.offer(rec(1))
    ledger.offer(rec(2))
    assert steps(ledger.agreed(2, 2)) == [2]
    assert ledger.written_step == 2 and ledger.tentative is None


def test_agreement_of_the_current_epoch_leaves_its_own_records_alone():
    ledger = CommittedLedger()
    ledger.offer(rec(1, epoch=3))
    assert ledger.agreed(3, 0) == [] and ledger.tentative["step"] == 1


def test_a_resumed_run_starts_after_its_checkpoint():
    ledger = CommittedLedger(written_step=60)
    assert ledger.agreed(1, 60) == [] and ledger.offer(rec(60)) == []
    ledger.offer(rec(61))
    assert steps(ledger.offer(rec(62))) == [61]


def test_every_step_exactly_once_through_repeated_splits():
    ledger = CommittedLedger()
    out: list[dict] = []
    epoch = 1
    for s in range(1, 101):
        out += ledger.offer(rec(s, epoch))
        if s % 17 == 0:  # rank 0 alone applied s; the others agree on s - 1 and redo it
            epoch += 1
            out += ledger.agreed(epoch, s - 1)
            out += ledger.offer(rec(s, epoch))
    out += ledger.close()
    assert steps(out) == list(range(1, 101))
    assert all(r["membership_epoch"] >= 2 for r in out if r["step"] % 17 == 0)


def test_records_ahead_of_a_gap_wait_for_the_catch_up():
    """A restarted coordinator hears rank 0's new reports before the members' catch-up records."""
    ledger = CommittedLedger(written_step=72)
    out = []
    for s in (160, 161, 162):
        out += ledger.offer(rec(s, epoch=1))
    assert out == [] and ledger.newest_step == 72
    for s in range(73, 160):
        out += ledger.offer(rec(s, epoch=1))
    out += ledger.agreed(2, 162)
    assert steps(out) == list(range(73, 163)) and not ledger.early


def test_an_agreement_discards_records_ahead_that_only_departed_members_applied():
    ledger = CommittedLedger(written_step=10)
    ledger.offer(rec(11, epoch=1))
    ledger.offer(rec(13, epoch=1))  # 12 never arrives: its reporter died
    assert ledger.agreed(2, 11) == [rec(11, epoch=1)] and not ledger.early
    assert ledger.offer(rec(12, epoch=2)) == [] and ledger.offer(rec(13, epoch=2)) == [rec(12, epoch=2)]


def test_an_outage_longer_than_the_kept_records_leaves_a_stated_gap_not_a_freeze():
    """The coordinator was down while steps 101..5000 were committed. Its new incarnation gets rank
    0's reports from 5001 on, and at the epoch agreement the members' kept records (the newest
    2048: 2953..5000). Steps 101..2952 are gone: history states the gap once and goes on, rather
    than parking every later record ahead of it forever."""
    ledger = CommittedLedger(written_step=100)
    written = []
    for s in range(5001, 5101):
        written += ledger.offer(rec(s, epoch=2))
    for s in range(2953, 5001):  # the catch-up that travels with the agreement
        written += ledger.offer(rec(s, epoch=2))
    written += ledger.agreed(3, 5100)
    written += ledger.offer(rec(5101, epoch=3))
    assert steps(written) == list(range(2953, 5101)), f"history froze at step {ledger.written_step}"
    assert ledger.gaps == [(101, 2952)] and not ledger.early


def test_records_ahead_of_a_gap_are_bounded():
    """Reports that keep arriving ahead of a gap (nobody can fill it) never grow without bound: past
    the limit the gap is declared and history goes on from the oldest record held."""
    limit = 4096
    ledger = CommittedLedger(written_step=10)
    written = []
    for s in range(1000, 1000 + 3 * limit):
        written += ledger.offer(rec(s))
    assert len(ledger.early) <= limit, f"{len(ledger.early)} records held ahead of the gap"
    assert ledger.gaps and ledger.gaps[0] == (11, 999)
    assert steps(written) == list(range(1000, written[-1]["step"] + 1))
