"""Long polls on a job's progress: what `ElasticJob.wait_for` waits on.

A driver that waits for something to happen in a job (an event of some kind, a step) asks the
coordinator once and is answered when something changed, instead of asking for the status and
re-reading the run's files many times a second. The feed is one of the journal's listeners: it hears
of every event and every newest history record, and wakes the calls waiting on it. Events are
numbered by their line in `events.jsonl` (the journal's `count`), so a number stays valid across
coordinator restarts.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class Feed:
    """Wakes waiting calls on each event and each newest record; costs nothing while nobody waits."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._waiting = 0

    def event(self, event: Any) -> None:
        self._wake()

    def record(self, record: dict) -> None:
        self._wake()

    def changed(self) -> None:
        """Something a waiting call may look for changed that is neither an event nor a record (a plan)."""
        self._wake()

    def close(self) -> None:
        """Nothing to let go of: a waiting `status` call times out on its own."""

    def _wake(self) -> None:
        # events are also recorded from threads (the run report's), hence the loop's thread-safe call
        if self._waiting and self._loop is not None and self._changed is not None:
            self._loop.call_soon_threadsafe(self._changed.set)

    async def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Returns once `ready()` holds (checked now and after each change), or after `timeout` seconds;
        says whether it held."""
        loop = asyncio.get_running_loop()
        if self._changed is None:
            self._loop, self._changed = loop, asyncio.Event()
        changed = self._changed
        deadline = loop.time() + timeout
        self._waiting += 1
        try:
            while not ready():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                changed.clear()  # no await since `ready()`: a change now is set after this, and wakes us
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except asyncio.TimeoutError:
                    return ready()
            return True
        finally:
            self._waiting -= 1
