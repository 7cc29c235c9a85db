"""Replica groups over a membership epoch's ranks, pure: which members shard one replica among them, and
which members hold the same shard in every group.

With `group_size` k, the epoch's n ranks form n / k replica groups of consecutive ranks: group g is ranks
g*k .. g*k + k - 1, and rank g*k + i holds shard i of the group's replica (its parameters, gradients and
optimizer state cut k ways). The members that hold shard i in every group, ranks i, k + i, 2k + i, ..., are
its *peers*: they keep their shards equal (the policy's cross-group reduction runs among them).
"""
from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A world that cannot be cut into replica groups of the size asked for."""


@dataclass(frozen=True)
class ShardLayout:
    world_size: int
    group_size: int

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise LayoutError(f"sharding.group_size must be at least 1 (got {self.group_size})")
        if self.world_size % self.group_size:
            raise LayoutError(f"{self.world_size} workers do not form replica groups of {self.group_size}: "
                              f"the number of workers must be a multiple of sharding.group_size")

    @property
    def groups(self) -> int:
        """How many replicas the epoch holds."""
        return self.world_size // self.group_size

    def group_of(self, rank: int) -> int:
        return rank // self.group_size

    def shard_of(self, rank: int) -> int:
        """Which shard of its group's replica `rank` holds (its rank inside the group)."""
        return rank % self.group_size

    def group_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks of `rank`'s replica group, in shard order."""
        first = self.group_of(rank) * self.group_size
        return tuple(range(first, first + self.group_size))

    def peer_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks holding `rank`'s shard, one in each group, in group order."""
        return tuple(range(self.shard_of(rank), self.world_size, self.group_size))
