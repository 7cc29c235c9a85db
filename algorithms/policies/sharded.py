"""BSP over sharded replica groups (`sharding.group_size` > 1): the members form groups of k, each group
holding one replica cut k ways by torch's FSDP, and every group commits the same step.

A step: forward and backward on the sharded model (FSDP gathers each block's parameters as it reaches it
and, in backward, reduce-scatters the gradients inside the group, summed, not divided: each member's loss
is already weighted by its share of the global batch); then `Shards.reduce` sums each member's gradient
shard over the members holding the same shard in the other groups, and the vote's tail (loss, samples,
newer plan, step metrics) over every member of the epoch, in one message each; then the update, on the
shard alone. The shards stay equal across groups because each sees the same summed gradient.

The replica's part that owns the groups (actors/training/sharded_replica.py) is attached to the
implementation (`attach`): it also keeps a member's copy of its neighbour's shard current (its share of
`reduce` and `update`), and the members' entry into each membership epoch re-cuts the replica from their
memory (`Entry.SHARDED`).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from algorithms.policies.allreduce import from_backend
from algorithms.policies.base import Algorithm, AlgorithmImpl, StepVote, VoteDraft
from algorithms.rules.kinds import SYNCHRONOUS, Entry
from core.comm_api import CommError


class Shards(Protocol):
    """What the step needs of the replica's sharded groups."""

    def reduce(self, model: torch.nn.Module, tail: torch.Tensor) -> torch.Tensor:
        """After backward: the gradient shards summed over the other groups, `tail` summed over the epoch
        (returned); the neighbour's copy receives this step's gradient shard. A CommError where the group fails."""

    def update(self, lr: float) -> None:
        """After the update: the neighbour's copy takes the same update."""


@runtime_checkable
class Sharded(Protocol):
    """A policy implementation that runs over sharded replica groups (the replica attaches them)."""

    def attach(self, shards: Shards) -> None: ...


class ShardedAllReduceImpl(AlgorithmImpl):
    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(algorithm, model, optimizer)
        self._shards: Shards | None = None

    def attach(self, shards: Shards) -> None:
        self._shards = shards

    def _attached(self) -> Shards:
        if self._shards is None:
            raise RuntimeError("sharded bsp: no replica groups attached (the replica attaches them when it binds the policy)")
        return self._shards

    def comm_error(self, err: BaseException) -> CommError | None:
        """FSDP's collectives run inside the forward and the backward, on torch's process group: what they
        raise (gloo's error; the workload's code under which it was raised may have wrapped it) is the group's."""
        cause = err if isinstance(err, RuntimeError) else err.__cause__
        if not isinstance(cause, RuntimeError):
            return None
        if self.comm is not None and (self.comm.failed or from_backend(cause)):
            return self.comm.failed_in_backend(cause)
        return CommError(f"sharded step: {str(cause).splitlines()[0]}") if from_backend(cause) else None

    def backward(self, loss: torch.Tensor) -> None:
        try:
            loss.backward()
        except RuntimeError as err:
            self.reraise(err)

    def finish_step(self, step: int, draft: VoteDraft) -> StepVote:
        return StepVote.reduced(self._attached().reduce(self.model, draft.tail(torch.float64)))

    def apply_update(self, step: int, lr: float) -> None:
        super().apply_update(step, lr)
        self._attached().update(lr)


class ShardedAllReduce(Algorithm):
    """`bsp` with `sharding.group_size` > 1 (chosen by `PolicyBinding.bind`; not a policy name of its own)."""

    name = "bsp"
    kind = SYNCHRONOUS
    impl = ShardedAllReduceImpl

    @property
    def entry(self) -> Entry:
        return Entry.SHARDED
