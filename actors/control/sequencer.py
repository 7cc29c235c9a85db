"""Each worker's messages to the coordinator run in the order the worker sent them.

Ray runs an asyncio actor's tasks as they arrive, without holding a task back for an earlier one from
the same caller (unlike a synchronous actor). The coordinator is an asyncio actor, and the order of a
worker's messages carries meaning: a report of step 2 ahead of step 1 makes history drop step 1 (a
record at or below a member's newest step is a stale one), and a joiner's first record ahead of its
`state_received` closes the reshape event without the state's source. So every message a worker
sends carries `(sender, seq)`, numbered from 0 by that sender, and the coordinator's handler first
waits its turn: until the sender's earlier messages have started, or `wait_s` has passed (an earlier
message that never arrives, a call lost with a restarting coordinator, must not hold the rest).

Waiting for the turn happens before a handler's first step, so a message never waits on anything but
its predecessors' arrival: no handler can deadlock another. A restarted coordinator hears from
workers numbering far past 0: it takes the first number it sees from each as that sender's start
(`trust_first`), rather than waiting out the bound once per worker.
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

Order = tuple[str, int]
"""(sender, seq): who sent a message, and its number among that sender's messages (from 0)."""

WAIT_S = 2.0
"""How long a message waits for an earlier one from its sender (a lost call's bound)."""

KEEP_SENDERS = 4096
"""Senders remembered (least recently heard from forgotten first); a forgotten sender starts afresh."""


class Sequencer:
    def __init__(self, wait_s: float = WAIT_S, keep: int = KEEP_SENDERS, trust_first: bool = False,
                 gave_up: Callable[[str, int], None] = lambda sender, seq: None) -> None:
        """`gave_up(sender, seq)` is told of each message that stopped waiting for a predecessor."""
        self.wait_s, self.keep, self.trust_first = wait_s, keep, trust_first
        self._on_give_up = gave_up
        self._next: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._changed: asyncio.Condition | None = None
        self.late = 0
        """Messages that arrived after a successor had already waited its bound out (run at once)."""
        self.gave_up = 0
        """Messages that stopped waiting for a predecessor that never came."""

    async def turn(self, order: Order | None) -> None:
        """Returns when the message numbered `order` may run (at once for an unnumbered one)."""
        if order is None:
            return
        sender, seq = order
        if self._changed is None:
            self._changed = asyncio.Condition()
        if self.trust_first and sender not in self._next:
            self._next[sender] = seq
        expected = self._next.get(sender, 0)
        if seq < expected:
            self.late += 1
            return
        if seq > expected:
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self._next.get(sender, 0) >= seq),
                                           self.wait_s)
                except asyncio.TimeoutError:
                    self.gave_up += 1
                    self._on_give_up(sender, seq)
        self._advance(sender, seq + 1)
        async with self._changed:
            self._changed.notify_all()

    def _advance(self, sender: str, to: int) -> None:
        self._next[sender] = max(self._next.get(sender, 0), to)
        self._next.move_to_end(sender)
        while len(self._next) > self.keep:
            self._next.popitem(last=False)
