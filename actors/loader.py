"""Background loading: the next steps' batches built by threads while the current step computes
(`workload.loader: {workers, prefetch}`).

The replica asks for the share at its cursor (`take`), then names the shares of the next `prefetch`
steps (`ahead`). Each share is keyed by everything it depends on (the cursor, the global batch, the
members, this slot, the micro-batch size), so a batch built for an old split (a reshape), or for a
cursor that moved back (a step that did not commit), is never used: `ahead` drops every pending
batch the new keys do not name, and a `take` that finds no batch for its key builds the share on the
step. What is trained is therefore exactly what the step would have built itself: the loader changes
when the work happens, never which samples. At most `prefetch` batches are held.

A batch's error (a sample that raises) comes back from `take`, as it would from the step; an error in
a batch that is dropped unused is dropped with it. Threads share the GIL: a `__getitem__` that waits
(a disk, a network, a sleep) overlaps the step, pure-Python decoding mostly does not. Randomness a
dataset draws from torch's global generator in a loader thread is not the step's seeded stream.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BatchLoader:
    def __init__(self, workers: int, prefetch: int) -> None:
        self.prefetch = prefetch
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="batch-loader")
        self._pending: OrderedDict[Hashable, Future] = OrderedDict()
        self.taken = 0
        """Shares that were ready (built ahead) when the step asked."""
        self.missed = 0
        """Shares the step built itself (none ahead for its key)."""

    def take(self, key: Hashable) -> Any | None:
        """The share built ahead for `key` (waiting for it if it is still being built), or None."""
        future = self._pending.pop(key, None)
        if future is None:
            self.missed += 1
            return None
        self.taken += 1
        return future.result()

    def ahead(self, wanted: list[tuple[Hashable, Callable[[], Any]]]) -> None:
        """Build these shares (in order) unless they are pending; drop every pending one not named."""
        keys = {key for key, _ in wanted}
        for key in [k for k in self._pending if k not in keys]:
            self._pending.pop(key).cancel()
        for key, build in wanted[:self.prefetch]:
            if key not in self._pending:
                self._pending[key] = self._pool.submit(build)

    def pending(self) -> list[Hashable]:
        return list(self._pending)

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
