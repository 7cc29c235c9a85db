"""The holder of a run's Ray Data blocks: one detached actor per run that materializes the workload's
`ray.data.Dataset` once and owns its blocks for as long as the run lasts.

Every member asks it for the blocks (object references and row counts, in dataset order) and reads only
the ones its shares touch (actors/training/sources.py `BlockSource`). The holder, not a member, owns them, so a
member's death loses no block; it is detached, so a coordinator restart does not end it; the
coordinator kills it when the run ends. A `--resume` is a new run: its holder materializes the dataset
again, and the checkpoint's data fingerprint (rows per block) must match (a changed dataset fails
the resume, named, rather than train other rows than the cursor says).
"""
from __future__ import annotations

from typing import Any

import ray

from actors import REMOTE_HOME
from actors.plan import holder_name


@ray.remote(num_cpus=0, max_restarts=-1)
class DataHolder:
    __module__ = REMOTE_HOME  # orchestrator/remote.py: Ray imports it from there
    def __init__(self) -> None:
        self._blocks: list[tuple[Any, int]] | None = None

    def blocks(self, dataset: Any) -> list[tuple[Any, int]]:
        """(object ref, rows) of each block; the first call materializes `dataset` (calls run one at a time)."""
        if self._blocks is None:
            from ray.data import DataContext

            DataContext.get_current().enable_progress_bars = False
            materialized = dataset.materialize()
            here = ray.put(None).owner_address()
            self._blocks = []
            for bundle in materialized.iter_internal_ref_bundles():
                for entry in bundle.blocks:
                    ref = entry.ref
                    if ref.owner_address() != here:
                        # A dataset built from in-memory items is "materialized" already, in the process that
                        # built it, and its blocks would die with that member: put a copy owned here.
                        ref = ray.put(ray.get(ref))
                    self._blocks.append((ref, int(entry.metadata.num_rows)))
        return self._blocks


def block_reader(job: str, run_id: str, namespace: str):
    """For actors/training/sources.py: `dataset -> blocks`, through this run's holder (created by whoever asks first)."""
    def blocks(dataset: Any) -> list[tuple[Any, int]]:
        # mypy keeps a decorated class's own type (python/mypy#3135): @ray.remote made it an ActorClass
        holder = DataHolder.options(name=holder_name(job, run_id), namespace=namespace,  # type: ignore[attr-defined]
                                    lifetime="detached", get_if_exists=True).remote()
        return ray.get(holder.blocks.remote(dataset))
    return blocks
