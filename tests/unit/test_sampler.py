"""The global sampler: exactly-once within a data epoch, rank splits cover the batch."""
from __future__ import annotations

import numpy as np
import pytest

from algorithms.rules.sampler import GlobalSampler, split_for_rank


def test_one_data_epoch_sees_every_sample_once_across_world_size_changes():
    sampler = GlobalSampler(103, seed=7)
    cursor, seen = 0, []
    for world, size in [(2, 10), (3, 12), (4, 9), (1, 20), (3, 30), (2, 22)]:
        batch = sampler.global_batch(cursor, size)
        parts = [split_for_rank(batch, r, world) for r in range(world)]
        assert np.array_equal(np.concatenate(parts), batch)
        seen.extend(batch.tolist())
        cursor += size
    assert sorted(seen[:103]) == list(range(103))


def test_batches_straddle_data_epochs_and_permutations_differ():
    sampler = GlobalSampler(10, seed=0)
    batch = sampler.global_batch(8, 4)
    assert list(batch[:2]) == list(sampler.permutation(0)[8:])
    assert list(batch[2:]) == list(sampler.permutation(1)[:2])
    assert not np.array_equal(sampler.permutation(0), sampler.permutation(1))


@pytest.mark.parametrize("n,world", [(10, 3), (7, 7), (5, 8), (128, 4)])
def test_split_sizes_differ_by_at_most_one(n, world):
    sizes = [len(split_for_rank(np.arange(n), r, world)) for r in range(world)]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
