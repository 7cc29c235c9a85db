"""The coordinator's background tasks: kept while they run, and ended together when it closes.

An event loop holds only weak references to its tasks, and a task nobody ends outlives the
coordinator on a loop it shares with others (a test, `benchmarks/control_plane.py`) or holds up
that loop's close. Every component in actors/control/ starts its tasks through the coordinator's one
`Tasks`, which keeps each task until it ends; `close` cancels the ones left and waits for them, at
most CLOSE_S. Each of them ends within that bound once cancelled: none of them catches
CancelledError, and a wait on a thread (`asyncio.to_thread`) ends when cancelled, leaving the thread
to finish its own bounded call.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

CLOSE_S = 1.0
"""How long `close` waits for the cancelled tasks to end."""


class Tasks:
    """Starts tasks on the running loop, keeps them until they end, and cancels those left."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    def later(self, delay: float, call: Callable[[], Awaitable[Any]]) -> asyncio.Task:
        """`call()` after `delay` seconds, as a task (one `close` ends, unlike a timer of the loop's)."""
        async def after() -> None:
            await asyncio.sleep(delay)
            await call()
        return self.spawn(after())

    def running(self) -> list[asyncio.Task]:
        """The tasks not yet ended, the caller's own left out."""
        current = asyncio.current_task()
        return [task for task in self._running if task is not current and not task.done()]

    def cancel(self) -> list[asyncio.Task]:
        """Cancel every task not yet ended (the caller's own left out); returns them."""
        left = self.running()
        for task in left:
            task.cancel()
        return left

    async def close(self, timeout: float = CLOSE_S) -> list[asyncio.Task]:
        """Cancel every task not yet ended and wait for them, at most `timeout`; returns those that did
        not end (each named in the log: it ignores its cancellation)."""
        left = self.cancel()
        if not left:
            return []
        _, pending = await asyncio.wait(left, timeout=timeout)
        for task in pending:
            log.warning("a coordinator task did not end within %.1fs of its cancellation: %r", timeout, task)
        return list(pending)
