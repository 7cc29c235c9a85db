"""Members' ends as they come, taken in batches of those that end together.

An outcome is a member's end as a detector saw it: its watch returned or raised (its run ended, its
process died), its lifeline ended, or the supervisor evicted it. Members that end together (a node's
workers, a rack, a storm) are handled as one batch, so the survivors re-form once: `next` gathers the
outcomes that follow the first within QUIET_S of each other (for at most GATHER_MAX_S), and stops
early once every member of the epoch is accounted for: ended in the batch, alive by its own report of
a failed collective in this epoch (`alive`), or running on this node with its process not exiting.
"""
from __future__ import annotations

import asyncio
import time

from actors.control.book import MembershipBook
from actors.control.members import Member
from actors.control.workers import WorkerGroup
from actors.messages import RunOutcome

Outcome = tuple[Member, str, RunOutcome, float]
"""(member, "finished" | "error" | "died", what its watch returned, when it was seen: time.time())."""
QUIET_S = 0.01
"""Outcomes that come within this of one another are handled together: one re-form for them all."""
GATHER_MAX_S = 0.1
"""...but the first of them waits at most this long for the others."""


class Outcomes:
    """The queue of members' ends, and the members of the epoch that said they are alive."""

    def __init__(self, book: MembershipBook, group: WorkerGroup) -> None:
        self.book, self.group = book, group
        self.queue: asyncio.Queue[Outcome] | None = None  # made on the event loop (start)
        self._alive: tuple[int, set[str]] = (-1, set())
        """(epoch, the members of that epoch that reported a failed collective in it): alive when they said so."""
        self._heard: asyncio.Event | None = None  # set at each such report (made on the event loop: start)

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self._heard = asyncio.Event()

    async def put(self, outcome: Outcome) -> None:
        assert self.queue is not None  # start() made it
        await self.queue.put(outcome)

    def alive(self, slot: str, epoch: int) -> None:
        """`slot` reported a failed collective in `epoch`: alive when it said so (a batch waits for it no more)."""
        if epoch == self.book.epoch:
            if self._alive[0] != epoch:
                self._alive = (epoch, set())
            self._alive[1].add(slot)
            if self._heard is not None:
                self._heard.set()

    async def next(self, timeout: float) -> list[Outcome]:
        """The next outcome (waiting at most `timeout`; [] if none), with every one that follows it
        within QUIET_S of the one before (for at most GATHER_MAX_S): members that end together (a
        node's workers, a rack, a storm) are handled as one batch. A second outcome of a member already
        in the batch (a death that both its watch and a probe found) is kept but does not extend the
        wait: only another member's end can be one more of the same storm. The wait ends early once
        every member of the epoch is accounted for: ended in the batch, alive by its own report of a
        failed collective in this epoch (a survivor of a death reports one), or running on this node
        with its process not exiting, so no storm is left to gather."""
        assert self.queue is not None and self._heard is not None  # start() made them
        try:
            batch = [await asyncio.wait_for(self.queue.get(), timeout)]
        except asyncio.TimeoutError:
            return []
        now = time.monotonic()
        end, quiet_until = now + GATHER_MAX_S, now + QUIET_S
        while (now := time.monotonic()) < min(end, quiet_until) and not self._accounted(batch):
            self._heard.clear()
            if self.queue.empty():
                getter = asyncio.ensure_future(self.queue.get())
                heard = asyncio.ensure_future(self._heard.wait())
                try:
                    await asyncio.wait((getter, heard), timeout=min(quiet_until, end) - now,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:  # this call cancelled too: neither waiter outlives it
                    heard.cancel()
                    got = getter.done()
                    if not got:
                        getter.cancel()  # an item a cancelled get was woken for stays in the queue
                if not got:
                    continue  # a report, or the window's end: the loop's test decides
                outcome = getter.result()
            else:
                outcome = self.queue.get_nowait()
            if all(outcome[0] is not other[0] for other in batch):
                quiet_until = time.monotonic() + QUIET_S
            batch.append(outcome)
        return batch

    def _accounted(self, batch: list[Outcome]) -> bool:
        """Whether every member of the epoch's plan has ended in `batch`, or said it is alive since, or
        runs on this node with its process not exiting (the kernel flags a killed process at once, so a
        member killed with the others would show it)."""
        live = set(self.book.live())
        ended = {outcome[0].slot for outcome in batch}
        if not live & ended:
            return False
        epoch, alive = self._alive
        unheard = live - ended - (alive if epoch == self.book.epoch else set())
        return all(self.group.process_state(m.node, m.pid) == "running" for m in (self.book.members[s] for s in unheard))
