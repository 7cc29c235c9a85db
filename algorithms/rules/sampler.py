"""The global sampler: one permutation per data epoch, one global cursor, split by rank.

Every member computes the same global batch from (seed, cursor) alone, so within a data epoch
no sample is lost or seen twice across any number of reshapes: a reshape changes only how the
next global batch is split. A batch may straddle two data epochs. Pure numpy, no Ray.
"""
from __future__ import annotations

import numpy as np


class GlobalSampler:
    def __init__(self, n_samples: int, seed: int) -> None:
        if n_samples < 1:
            raise ValueError("the training data set is empty")
        self.n = n_samples
        self.seed = seed
        self._cached: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def permutation(self, data_epoch: int) -> np.ndarray:
        cached = self._cached  # read once: a loader thread may replace it meanwhile (actors/training/loader.py)
        if cached[0] != data_epoch:
            cached = self._cached = (data_epoch, self.draw(data_epoch))
        return cached[1]

    def draw(self, data_epoch: int) -> np.ndarray:
        """Data epoch `data_epoch`'s order of the sample ids: a permutation seeded by (seed, epoch)."""
        return np.random.default_rng([self.seed, data_epoch]).permutation(self.n)

    def global_batch(self, cursor: int, size: int) -> np.ndarray:
        """The `size` sample ids that follow global position `cursor`."""
        out = []
        while size > 0:
            epoch, pos = divmod(cursor, self.n)
            take = min(size, self.n - pos)
            out.append(self.permutation(epoch)[pos:pos + take])
            cursor += take
            size -= take
        return np.concatenate(out) if len(out) > 1 else out[0]


def split_for_rank(batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Contiguous near-equal shares; the first `len % world` ranks get one more sample."""
    base, extra = divmod(len(batch), world_size)
    start = rank * base + min(rank, extra)
    return batch[start:start + base + (1 if rank < extra else 0)]
