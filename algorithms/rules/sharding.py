"""Replica groups over a membership epoch's ranks, pure: which members shard one replica among them, and
which members hold the same shard in every group.

With `group_size` k, the epoch's n ranks form n / k replica groups of consecutive ranks: group g is ranks
g*k .. g*k + k - 1, and rank g*k + i holds shard i of the group's replica (its parameters, gradients and
optimizer state cut k ways). The members that hold shard i in every group, ranks i, k + i, 2k + i, ..., are
its *peers*: they keep their shards equal (the policy's cross-group reduction runs among them).
"""
from __future__ import annotations

from collections.abc import Sequence
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


def row_range(rows: int, shard: int, shards: int) -> tuple[int, int]:
    """The rows [start, end) of dim 0 that shard `shard` of `shards` holds, as FSDP2 cuts a parameter:
    chunks of ceil(rows / shards), the last ones shorter or empty."""
    chunk = -(-rows // shards)
    return min(shard * chunk, rows), min((shard + 1) * chunk, rows)


@dataclass(frozen=True)
class RowMove:
    """Rows of one parameter (and of the optimizer's state for it) that go from the member holding an old
    shard to the member whose new shard takes them; `source == target` is a copy in place."""

    source: int
    """The new epoch's rank that holds old shard `old_shard` (its own, or a mirror of a departed member's)."""
    target: int
    old_shard: int
    rows: tuple[int, int]


def reshard_moves(rows: int, old: int, new: ShardLayout, holders: Sequence[Sequence[int]]) -> list[RowMove]:
    """How a parameter of `rows` rows, cut `old` ways, is cut `new.group_size` ways among the new epoch's
    members (`new`: its layout), where `holders[j]` are the new epoch's ranks that hold old shard j (every
    member of a group with the old layout holds its own; a mirror holds its neighbour's). Each new rank
    takes its shard's rows from itself where it holds the old shard they are in, else from the
    lowest-ranked holder."""
    if len(holders) != old:
        raise ValueError(f"holders: {len(holders)} old shards listed, {old} expected")
    lost = [j for j, held in enumerate(holders) if not held]
    if lost:
        raise LayoutError(f"old shards {lost} are held by no member: the state is gone from memory")
    moves = []
    for target in range(new.world_size):
        start, end = row_range(rows, new.shard_of(target), new.group_size)
        for j, held in enumerate(holders):
            lo, hi = row_range(rows, j, old)
            lo, hi = max(lo, start), min(hi, end)
            if lo < hi:
                moves.append(RowMove(target if target in held else min(held), target, j, (lo, hi)))
    return moves


@dataclass(frozen=True)
class HeldView:
    """What one member of a new membership epoch holds of the replica, as it tells the others on entry."""

    mark: int
    """The step of its committed state (-1: it holds none, a joiner)."""
    group_size: int
    """How many ways that state was cut (0: none)."""
    shards: tuple[int, ...]
    """The shards of it this member holds: its own, then a mirror's."""

    WIDTH = 4
    """Its encoding's length: (mark, group size, up to two shards, -1 where there is none)."""

    def encode(self) -> list[int]:
        if len(self.shards) > self.WIDTH - 2:
            raise ValueError(f"a member holds at most {self.WIDTH - 2} shards (got {self.shards})")
        return [self.mark, self.group_size, *self.shards, *[-1] * (self.WIDTH - 2 - len(self.shards))]

    @classmethod
    def decode(cls, values: Sequence[int]) -> HeldView:
        mark, size, *shards = (int(v) for v in values)
        return cls(mark, size, tuple(s for s in shards if s >= 0))


@dataclass(frozen=True)
class Recut:
    """Where a new epoch's members stand: the committed state at `mark`, cut `old_group_size` ways, whose
    shard j the ranks `holders[j]` hold; `replaced`: the ranks whose own state is not that one (a joiner,
    a member behind, or one ahead of the newest state the members hold whole) and is dropped."""

    mark: int
    old_group_size: int
    holders: tuple[tuple[int, ...], ...]
    replaced: tuple[int, ...]


def plan_recut(views: Sequence[HeldView]) -> Recut | None:
    """The newest committed state whose every shard some member of the new epoch holds at that step
    (members may stand one step apart: a vote can finish on some and fail on others), or None where no
    state is held whole any more (two adjacent members of one group lost together: the job goes back to
    its newest checkpoint)."""
    for mark in sorted({v.mark for v in views if v.mark >= 0}, reverse=True):
        at = [(rank, v) for rank, v in enumerate(views) if v.mark == mark]
        sizes = {v.group_size for _, v in at}
        if len(sizes) != 1:
            raise ValueError(f"the members at step {mark} hold it cut {sorted(sizes)} ways: one layout per step")
        k = sizes.pop()
        holders = tuple(tuple(rank for rank, v in at if j in v.shards) for j in range(k))
        if all(holders):
            return Recut(mark, k, holders, tuple(rank for rank, v in enumerate(views) if v.mark != mark))
    return None


def group_size_for(world_size: int, group_size: int) -> int:
    """The replica groups' size in an epoch of `world_size` members, for a job that asks for `group_size`:
    the smallest divisor of the world that is at least `group_size` (the whole world when none is smaller).
    A member then never holds more than 1/`group_size` of the replica, and every member takes part: four
    members in groups of two that lose one go on as one group of three, and back to two groups of two when
    a fourth joins."""
    if world_size < 1 or group_size < 1:
        raise LayoutError(f"a world of {world_size} in groups of {group_size}: both must be at least 1")
    return next(k for k in range(min(group_size, world_size), world_size + 1) if world_size % k == 0)
