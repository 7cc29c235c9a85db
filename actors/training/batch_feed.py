"""How a replica's data reaches its step: this rank's share of each global batch, in micro-batches,
read by the data source (actors/training/sources.py), built ahead by a loader where one is configured, moved
to the device; and each step's random seed.

`BatchFeed` owns the source, the loader, the process fetcher and the copy stream; it is given a plan, a
data cursor and (for the policies that deal samples) the ids dealt, never the replica.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from actors.plan import Plan
from actors.training.loader import BatchLoader, ProcessFetcher
from actors.training.sources import Fetched
from actors.training.workload import map_tensors, pinned, to_device
from algorithms.rules.sampler import split_for_rank
from core.schema import JobConfig, WorkloadRefused


class BatchFeed:
    """One member's data: its share of each step's batch, on its device."""

    def __init__(self, source: Any, cfg: JobConfig, slot: str, device: torch.device, config: dict) -> None:
        """`config`: the job's config as a dict (what a process fetcher rebuilds the source from)."""
        self.source = source
        self.slot = slot
        self.device = device
        self.micro_batch = cfg.workload.micro_batch
        loader = cfg.workload.loader
        self._loader = BatchLoader(loader.workers, loader.prefetch) if loader.workers > 0 else None
        self._fetcher: ProcessFetcher | None = None
        if loader.workers > 0 and loader.processes:
            if source.kind not in ("map-style", "datasets"):
                raise WorkloadRefused(f"workload.loader.processes reads map-style or Hugging Face data by id; this "
                                      f"train_data is a {source.kind} source (use loader threads)")
            self._fetcher = ProcessFetcher(loader.workers, config)
        self._copy_stream: Any = None
        """The loader's CUDA stream for its copies to the device (created at its first batch on a GPU)."""

    def micro_batches(self, plan: Plan, cursor: int, dealt: np.ndarray | None) -> tuple[np.ndarray, list[Fetched]]:
        """This rank's share of the global batch at `cursor` (or the ids the policy `dealt`), in chunks of
        at most `workload.micro_batch`, ready for the step to use. With a loader
        (`workload.loader.workers`), the share at the cursor was built ahead while earlier steps
        computed, and the next ones are asked for now."""
        if dealt is not None:
            out = dealt, self._chunks(dealt, cursor)
        elif self._loader is None:
            out = self.share(plan, cursor)
        else:
            built = self._loader.take(self._batch_key(plan, cursor))
            self._loader.ahead([(self._batch_key(plan, ahead), functools.partial(self.share, plan, ahead, True))
                                for ahead in (cursor + k * plan.global_batch for k in range(1, self._loader.prefetch + 1))])
            out = built if built is not None else self.share(plan, cursor)
        if self._copy_stream is not None:
            self._ready(out[1])
        return out

    def share(self, plan: Plan, cursor: int, ahead: bool = False) -> tuple[np.ndarray, list[Fetched]]:
        """This member's share of the global batch at `cursor` under `plan`."""
        rank = plan.rank_of(self.slot)
        if rank is None:
            raise RuntimeError(f"{self.slot} is not a member of plan {plan.version}")
        mine = self.ids_of(plan, cursor, rank)
        return mine, self._chunks(mine, cursor, ahead)

    def ids_of(self, plan: Plan, cursor: int, rank: int) -> np.ndarray:
        """The sample ids of rank `rank`'s share of the global batch at `cursor` under `plan`."""
        return split_for_rank(self.source.global_batch(cursor, plan.global_batch), rank, len(plan.members))

    def _batch_key(self, plan: Plan, cursor: int) -> tuple:
        """What a share depends on: a batch built for another split (a reshape) or another cursor (a
        step that did not commit, a state received) is never taken."""
        return cursor, plan.global_batch, plan.members, self.micro_batch

    def _chunks(self, mine: np.ndarray, cursor: int, ahead: bool = False) -> list[Fetched]:
        """The share `mine` of the global batch at `cursor`, read by the data source (actors/training/sources.py)
        in micro-batches and moved to the device. Built ahead by the loader on a GPU, a batch is pinned
        and copied on the loader's own CUDA stream, so the copy overlaps the step's kernels; the step
        waits for the copy's event before it uses the batch (`_ready`)."""
        size = self.micro_batch or max(len(mine), 1)
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

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
        if self._fetcher is not None:
            self._fetcher.close()


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


def seed_step(seed: int, slot_index: int, step: int, device: torch.device) -> None:
    """Randomness (dropout, augmentation in torch) from a stream derived from (seed, slot, step)."""
    value = step_seed(seed, slot_index, step)
    torch.default_generator.manual_seed(value)  # torch.manual_seed walks every backend: 175 us
    if device.type == "cuda":
        torch.cuda.manual_seed(value)
