"""A replica's part in sharded replica groups (`sharding.group_size` > 1): what this member holds of the
replica in each membership epoch, and the moves of it that the step, the entry and the end make.

At each membership epoch's entry every member tells the others what it holds (its shard of the
committed state, its copy of its neighbour's, or, before the first epoch, the whole initial or loaded
model), the replica is re-cut into the new epoch's groups from their memory alone, and this member
trains a new model and optimizer over its new group (actors/training/sharding.py `enter_epoch`). The
first entry frees the whole model the member was built with: from then on it holds its shard, and its
copy of its neighbour's with `sharding.mirror`.

The step reaches it through the policy (algorithms/policies/sharded.py `Shards`): the gradient shards
summed across groups with the vote, and the neighbour's copy kept current. At the end of the run the
members of the first group gather the replica whole (`finish`), which rank 0 keeps as the final model.
"""
from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from typing import Any

import torch

from actors.training.sharding import ShardedState, TensorBytes, enter_epoch, tensor_bytes, whole
from core.comm_api import Communicator


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`model`'s structure on the meta device (no memory for its tensors), tied parameters still tied: each
    parameter and buffer is made once on the meta device and the copy takes it wherever the model has it
    (`Module.to("meta")` would convert a tied parameter once per module that holds it, untying it)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


class ReplicaShards:
    """One member's shards of the replica, re-cut at every membership epoch; their only writer."""

    def __init__(self, group_size: int, mirror: bool, model: torch.nn.Module,
                 make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> None:
        """`model`: the whole model the member was built with (its structure is kept, on the meta device,
        to build each epoch's sharded model from; its buffers are copied into each)."""
        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise ValueError("sharding: the model has BatchNorm, whose running statistics replica groups do not "
                             "keep across re-cuts yet; use sharding.group_size: 1")
        importlib.import_module("torch._dynamo")  # FSDP's first `fully_shard` imports it (0.5-0.8 s): here, not on a joiner's entry
        self._group_size, self._mirror = group_size, mirror
        self._make_optimizer = make_optimizer
        self._template = meta_copy(model)
        self._buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        self.state: ShardedState | None = None
        """What this member holds in the current (or the last) membership epoch."""
        self.whole: tuple[dict[str, Any], dict[str, Any]] | None = None
        """(model state, optimizer state) of the replica gathered whole at the end of the run (rank 0)."""

    def _build(self) -> torch.nn.Module:
        return copy.deepcopy(self._template)

    def enter(self, comm: Communicator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> ShardedState:
        """Enter a membership epoch over `comm` (every member at once): re-cut the replica from what the
        members hold. `model`/`optimizer`/`step`: what this member trains now (before the first epoch: the
        whole model, and the optimizer whose state a loaded checkpoint gave it)."""
        first = self.state is None
        if self.state is None:  # (not `first`: the type checker narrows on this test)
            view, held = whole(model, step, optimizer)
        else:
            view, held = self.state.view(step), self.state.held()
        self.state = enter_epoch(comm, self._group_size, view, held, self._build, self._make_optimizer, self._mirror,
                                 buffers=self._buffers)
        if first:
            model.to("meta")  # the whole model this member was built with: its shard is all it holds from now on
        return self.state

    def leave(self) -> None:
        """The epoch's group is about to be released: torch forgets it (the shards are kept for the next entry)."""
        if self.state is not None:
            self.state.group.close()

    def reduce(self, model: torch.nn.Module, tail: torch.Tensor) -> torch.Tensor:
        state = self._current()
        summed = state.group.reduce_across(model, tail)
        if state.mirror is not None:
            state.mirror.receive(model)
        assert summed is not None  # a tail was given
        return summed

    def update(self, lr: float) -> None:
        state = self._current()
        if state.mirror is not None:
            state.mirror.update(lr)

    def in_first_group(self) -> bool:
        """Whether this member is in the epoch's first replica group (rank 0's: it gathers and evaluates)."""
        state = self._current()
        return state.group.layout.group_of(state.group.rank) == 0

    def finish(self, keep: bool) -> None:
        """The end of the run, for the members of the first group: the replica gathered whole, kept where
        `keep` (rank 0, which hands the final model to the coordinator)."""
        gathered = self.gather()
        self.whole = gathered if keep else None

    def gather(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model state, optimizer state) of the replica whole, as an unsharded model's and optimizer's: every
        member of the first group calls it at once."""
        state = self._current()
        return state.group.gathered(state.model, state.optimizer)

    def held_bytes(self) -> dict[str, int]:
        """What this member holds of the training state, in bytes: its shard's `parameters`, `gradients` and
        `optimizer` state, its copy of its neighbour's shard (`mirror`: parameters, gradient and optimizer
        state) and their `total`."""
        state = self._current()
        held: TensorBytes = tensor_bytes(state.model, state.optimizer)
        mirror = 0 if state.mirror is None else state.mirror.tensor_bytes()
        return {"parameters": held.parameters, "gradients": held.gradients, "optimizer": held.optimizer,
                "mirror": mirror, "total": held.total + mirror}

    def _current(self) -> ShardedState:
        if self.state is None:
            raise RuntimeError("sharding: this member has not entered a membership epoch")
        return self.state
