"""The committed-step ledger: every step reaches history exactly once, and a step that only
departed members applied (a split last vote) is dropped and redone, never written."""
from __future__ import annotations

from actors.ledger import CommittedLedger


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
    assert ledger.agreed(2, 4, rec(4, epoch=1)) == []
    assert [d["step"] for d in ledger.dropped] == [5] and ledger.written_step == 4
    assert ledger.offer(rec(5, epoch=2, loss=50.0)) == []
    written = ledger.offer(rec(6, epoch=2))
    assert steps(written) == [5] and written[0]["loss"] == 50.0 and written[0]["membership_epoch"] == 2


def test_agreement_supplies_a_step_rank_0_never_reported():
    """Rank 0 failed its last vote (step 31) while the others committed 32: the agreement carries 32."""
    ledger = CommittedLedger()
    for s in range(1, 32):
        ledger.offer(rec(s, epoch=1))
    written = ledger.agreed(2, 32, rec(32, epoch=1, loss=3.2))
    assert steps(written) == [31, 32] and written[1]["loss"] == 3.2
    assert ledger.tentative is None and ledger.written_step == 32
    assert ledger.offer(rec(32, epoch=1)) == []
    assert ledger.offer(rec(33, epoch=2)) == [] and steps(ledger.close()) == [33]


def test_agreement_on_the_tentative_step_confirms_it():
    ledger = CommittedLedger()
    ledger.offer(rec(1))
    ledger.offer(rec(2))
    assert steps(ledger.agreed(2, 2, rec(2))) == [2]
    assert ledger.written_step == 2 and ledger.tentative is None


def test_agreement_of_the_current_epoch_leaves_its_own_records_alone():
    ledger = CommittedLedger()
    ledger.offer(rec(1, epoch=3))
    assert ledger.agreed(3, 0, None) == [] and ledger.tentative["step"] == 1


def test_a_resumed_run_starts_after_its_checkpoint():
    ledger = CommittedLedger(written_step=60)
    assert ledger.agreed(1, 60, rec(60)) == [] and ledger.offer(rec(60)) == []
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
            out += ledger.agreed(epoch, s - 1, rec(s - 1, epoch - 1))
            out += ledger.offer(rec(s, epoch))
    out += ledger.close()
    assert steps(out) == list(range(1, 101))
    assert all(r["membership_epoch"] >= 2 for r in out if r["step"] % 17 == 0)
