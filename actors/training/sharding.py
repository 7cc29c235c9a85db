"""Sharded replica groups: torch's FSDP inside a replica group, the shards kept equal across groups.

With `group_size` k (algorithms/rules/sharding.py's `ShardLayout`), the members of one replica group hold
one replica between them: `fully_shard` (torch's FSDP2) cuts every parameter, its gradient and the
optimizer's state for it k ways over a device mesh made from the group's own communicator (lent to torch
as its world: actors/transport/torch_world.py). Backward then ends with each member holding the sum over
its group of its shard's gradient (FSDP's reduce-scatter, told not to divide: the gradients arrive already
weighted by each member's share of the global batch, as everywhere in this project); `reduce_across` sums
that shard over the members holding it in every other group (its peers) in one flat message, so every
member holds its shard of the global batch's mean gradient, and the optimizer steps on the shard alone.

One step's communication per member: FSDP's all-gathers of the parameters (forward, and backward again)
and its reduce-scatter inside the group, then one all-reduce of 1/k of the gradients among the n/k peers,
and the vote's tail summed over the whole epoch's group.

What the replica needs of it besides the step: `full_state()` (each parameter gathered whole: the final
model, a checkpoint, an evaluation) and `tensor_bytes()` (what one member holds).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from actors.transport import torch_world
from algorithms.rules.sharding import ShardLayout
from core.comm_api import Communicator


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP gathers one at a time: every element of every `ModuleList` (a transformer's
    blocks), then the model itself (what is left: embeddings, a head tied to them, final norms). A
    parameter shared between two units would be sharded twice: a tied head stays with the root."""
    units = [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst
             if any(True for _ in m.parameters())]
    return [*units, model]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This member's part of `tensor` (a sharded parameter's, gradient's or optimizer state's)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class TensorBytes:
    """What one member holds of the training state, in bytes."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> TensorBytes:
    """The bytes of this member's parameters, gradients and optimizer state (its shards where sharded)."""
    def size(tensors: Iterable[torch.Tensor]) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in tensors)

    params = list(model.parameters())
    state = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()
                                          if isinstance(v, torch.Tensor) and v.dim() > 0]
    return TensorBytes(size(params), size(p.grad for p in params if p.grad is not None), size(state))


class ShardedGroup:
    """One member's place in a membership epoch's replica groups: the group's mesh (FSDP's) and its peers'
    communicator (the cross-group sum). Formed by every member of the epoch at the same point."""

    def __init__(self, comm: Communicator, layout: ShardLayout, rank: int) -> None:
        self.layout, self.rank, self.comm = layout, rank, comm
        group, shard = layout.group_of(rank), layout.shard_of(rank)
        inside = comm.subgroup(layout.group_ranks(rank), f"replica-{group}")
        peers = comm.subgroup(layout.peer_ranks(rank), f"shard-{shard}")
        if inside is None or peers is None:
            raise RuntimeError(f"sharding: the {type(comm).__name__} group forms no subgroups")
        ranked = inside.ranked_group()
        if ranked is None:
            raise RuntimeError(f"sharding: the {type(inside).__name__} group offers torch no process group")
        self.inside, self.peers = inside, peers
        device = getattr(inside, "device", torch.device("cpu")).type
        self._world = torch_world.lend(ranked, "nccl" if device == "cuda" else "gloo")
        self.mesh = DeviceMesh.from_group(ranked, device)

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` sharded in place over this group (its parameters become shards): build the optimizer
        after this. FSDP does not divide the reduced gradients (see the module's docstring)."""
        for unit in shard_units(model):
            fully_shard(unit, mesh=self.mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
        return model

    def reduce_across(self, model: torch.nn.Module, tail: torch.Tensor | None = None) -> torch.Tensor | None:
        """After backward: sum this member's gradient shards over its peers (one flat message), and
        `tail` (the vote's, float64) over the whole epoch's group; returns the summed tail."""
        summed = None
        handle = None
        if tail is not None:
            summed = tail.clone()
            handle = self.comm.all_reduce(summed)
        grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
        if grads and self.peers.world_size > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.peers.all_reduce(flat).wait()
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if handle is not None:
            handle.wait()
        return summed

    def full_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer whole (each member of the group calls it: the parameters are gathered)."""
        state = {}
        for name, value in model.state_dict().items():
            state[name] = value.full_tensor() if isinstance(value, DTensor) else value
        return state

    def close(self) -> None:
        """torch forgets the group (before the epoch's group is released)."""
        self._world.give_back()
