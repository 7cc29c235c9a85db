"""Each sender's messages run in the order sent, whatever order they arrive in (actors/control/sequencer.py)."""
from __future__ import annotations

import asyncio
import time

from actors.control.sequencer import Sequencer


async def _deliver(seq: Sequencer, arrivals: list[tuple[str, int]], ran: list[tuple[str, int]], gap_s: float = 0.01):
    async def one(order):
        await seq.turn(order)
        ran.append(order)

    tasks = []
    for order in arrivals:  # each arrives a little after the one before it
        tasks.append(asyncio.create_task(one(order)))
        await asyncio.sleep(gap_s)
    await asyncio.gather(*tasks)


def test_messages_arriving_out_of_order_run_in_the_order_sent():
    seq, ran = Sequencer(wait_s=5.0), []
    arrivals = [("a", 2), ("b", 1), ("a", 0), ("b", 0), ("a", 1), ("a", 3)]
    asyncio.run(_deliver(seq, arrivals, ran))
    assert [o for o in ran if o[0] == "a"] == [("a", i) for i in range(4)]
    assert [o for o in ran if o[0] == "b"] == [("b", 0), ("b", 1)]
    assert seq.gave_up == 0 and seq.late == 0, "no message waited its bound out: every predecessor arrived"


def test_a_message_whose_predecessor_never_arrives_runs_after_the_bound():
    told: list = []
    seq, ran = Sequencer(wait_s=0.3, gave_up=lambda sender, n: told.append((sender, n))), []
    started = time.monotonic()
    asyncio.run(_deliver(seq, [("a", 0), ("a", 2), ("a", 3)], ran))
    waited = time.monotonic() - started
    assert ran == [("a", 0), ("a", 2), ("a", 3)]
    assert waited >= 0.3, waited  # it waited its bound out (a lower bound: load can only lengthen it)
    assert seq.gave_up == 1 and told == [("a", 2)]  # ("a", 2) gave up on ("a", 1); ("a", 3) then ran in its turn
    ran.clear()
    asyncio.run(_deliver(seq, [("a", 1)], ran))  # the lost one, very late: runs at once
    assert ran == [("a", 1)] and seq.late == 1


def test_a_restarted_coordinator_takes_each_senders_first_number_as_its_start():
    seq, ran = Sequencer(wait_s=5.0, trust_first=True), []
    asyncio.run(_deliver(seq, [("a", 57), ("a", 58)], ran))
    assert ran == [("a", 57), ("a", 58)] and seq.gave_up == 0, "57 did not wait for 0..56"


def test_forgotten_senders_are_bounded():
    seq = Sequencer(wait_s=0.0, keep=3)
    asyncio.run(_deliver(seq, [(f"s{i}", 0) for i in range(10)], [], gap_s=0))
    assert len(seq._next) == 3
