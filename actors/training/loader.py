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
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import numpy as np


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


_SOURCE: Any = None
"""In a loader process: the job's data source, built once by `_build_source`."""


def _build_source(config: dict) -> None:
    global _SOURCE
    import torch

    from actors.training.sources import source_for
    from actors.training.workload import build_workload
    from core.schema import JobConfig, parse

    torch.set_num_threads(1)
    cfg = parse(JobConfig, config)
    workload = build_workload(cfg)
    _SOURCE = source_for(workload.train_data, cfg.seed, cfg.workload.on_bad_sample,
                         collate=getattr(workload, "collate_fn", None))


def _fetch(ids: np.ndarray, cursor: int) -> Any:
    return _SOURCE.fetch(ids, cursor)


class ProcessFetcher:
    """`workload.loader.processes`: the loader's threads hand each read to one of `workers` processes,
    each of which built the workload once (its factory, in a fresh interpreter: `spawn`), so decoding
    that holds the GIL runs beside the step instead of inside it. A batch comes back through shared
    memory (torch's multiprocessing pickler). Map-style and Hugging Face data only: the samples a
    process reads are named by id, and a stream or a Ray Data source has state in the worker."""

    def __init__(self, workers: int, config: dict) -> None:
        import torch.multiprocessing as tmp

        self._pool = ProcessPoolExecutor(max_workers=workers, mp_context=tmp.get_context("spawn"),
                                         initializer=_build_source, initargs=(config,))

    def fetch(self, ids: np.ndarray, cursor: int) -> Any:
        return self._pool.submit(_fetch, ids, cursor).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
