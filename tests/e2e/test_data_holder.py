"""The Ray Data holder (actors/training/data_holder.py) owns a run's blocks: a dataset built from in-memory items
is "materialized" already in the process that built it, so the holder takes its own copy and the
blocks outlive that process (the mechanism switched off, a block read after the builder's death
raises OwnerDiedError)."""
from __future__ import annotations

import numpy as np
import ray

from actors.training.data_holder import block_reader
from actors.training.sources import BlockSource


@ray.remote(num_cpus=0)
class Builder:
    def blocks(self, namespace: str) -> list:
        import ray.data

        ds = ray.data.from_items([{"id": i, "x": float(i)} for i in range(300)], override_num_blocks=100)
        return block_reader("holder-test", "r1", namespace)(ds)


def test_the_blocks_outlive_the_member_that_built_the_dataset(ray_session):
    namespace = ray.get_runtime_context().namespace
    builder = Builder.remote()
    blocks = ray.get(builder.blocks.remote(namespace))
    ray.kill(builder)
    try:
        assert len(blocks) == 100 and sum(rows for _, rows in blocks) == 300
        source = BlockSource(blocks, seed=1)
        ids = source.global_batch(0, 300)
        batch = source.fetch(ids, 0).batch
        assert np.array_equal(batch["id"].numpy(), ids) and np.array_equal(batch["x"].numpy(), ids.astype(float))
    finally:
        ray.kill(ray.get_actor("holder-test/r1/data", namespace=namespace))
