"""How a replica's data reaches its step: this rank's share of each global batch, in micro-batches,
read by the data source (actors/training/sources.py), built ahead by a loader where one is configured, moved
to the device; and each step's random seed.

`Feeding` is a mixin of `Replica` (actors/training/replica.py), whose step calls `_micro_batches` and
`_seed_step`; batches of tensors move with actors/training/workload.py's helpers.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from actors.plan import Plan
from actors.training.replica_base import ReplicaBase
from actors.training.sources import Fetched
from actors.training.workload import map_tensors, pinned, to_device
from algorithms.rules.sampler import split_for_rank


class Feeding(ReplicaBase):
    """A `Replica`'s data feed: its share of each step's batch, on its device, and the step's seed."""

    def _micro_batches(self, plan: Plan, mine: np.ndarray | None) -> tuple[np.ndarray, list[Fetched]]:
        """This rank's share of the next global batch (or the ids the policy dealt), in chunks of at
        most `workload.micro_batch`. With a loader (`workload.loader.workers`), the share at the
        cursor was built ahead while earlier steps computed, and the next ones are asked for now."""
        if mine is not None:
            return mine, self._chunks(mine, self.cursor)
        if self._loader is None:
            return self._share(plan, self.cursor)
        built = self._loader.take(self._batch_key(plan, self.cursor))
        self._loader.ahead([(self._batch_key(plan, cursor), functools.partial(self._share, plan, cursor, True))
                            for cursor in (self.cursor + k * plan.global_batch for k in range(1, self._loader.prefetch + 1))])
        return built if built is not None else self._share(plan, self.cursor)

    def _share(self, plan: Plan, cursor: int, ahead: bool = False) -> tuple[np.ndarray, list[Fetched]]:
        ids = self.source.global_batch(cursor, plan.global_batch)
        mine = split_for_rank(ids, self._rank_in(plan), len(plan.members))
        return mine, self._chunks(mine, cursor, ahead)

    def _batch_key(self, plan: Plan, cursor: int) -> tuple:
        """What a share depends on: a batch built for another split (a reshape) or another cursor (a
        step that did not commit, a state received) is never taken."""
        return cursor, plan.global_batch, plan.members, self.slot, self.cfg.workload.micro_batch

    def _chunks(self, mine: np.ndarray, cursor: int, ahead: bool = False) -> list[Fetched]:
        """The share `mine` of the global batch at `cursor`, read by the data source (actors/training/sources.py)
        in micro-batches and moved to the device. Built ahead by the loader on a GPU, a batch is pinned
        and copied on the loader's own CUDA stream, so the copy overlaps the step's kernels; the step
        waits for the copy's event before it uses the batch (`_ready`)."""
        size = self.cfg.workload.micro_batch or max(len(mine), 1)
        chunks = [mine] if size >= len(mine) else [mine[i:i + size] for i in range(0, len(mine), size)]
        fetch = self._fetcher.fetch if self._fetcher is not None and ahead else self.source.fetch
        out = [fetch(ids, cursor) for ids in chunks]
        if self.device.type == "cuda" and ahead:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._copy_stream):
                for fetched in out:
                    fetched.batch = to_device(pinned(fetched.batch), self.device)
                    fetched.ready = torch.cuda.Event()
                    fetched.ready.record(self._copy_stream)
        elif self.device.type != "cpu":
            for fetched in out:
                fetched.batch = to_device(fetched.batch, self.device)
        return out

    def _ready(self, micro: list[Fetched]) -> None:
        """The step's stream waits for the copies of batches built ahead; their memory is then the
        step stream's too (the caching allocator must not hand it out while the step uses it)."""
        stream = torch.cuda.current_stream(self.device)
        for fetched in micro:
            if fetched.ready is not None:
                stream.wait_event(fetched.ready)
                map_tensors(fetched.batch, lambda t: t.record_stream(stream))
                fetched.ready = None

    def _seed_step(self) -> None:
        """Randomness (dropout, augmentation in torch) from a stream derived from (seed, slot, step)."""
        value = step_seed(self.cfg.seed, self._slot_index, self.step)
        torch.default_generator.manual_seed(value)  # torch.manual_seed walks every backend: 175 us
        if self.device.type == "cuda":
            torch.cuda.manual_seed(value)


_MASK64 = (1 << 64) - 1


def step_seed(*values: int) -> int:
    """A 63-bit seed from a few integers (job seed, slot, step): splitmix64 folded over them, in plain
    integers (a numpy SeedSequence per step cost ~30 us of the hot path)."""
    x = 0
    for v in values:
        x = (x ^ (v & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 31
    return x >> 1
