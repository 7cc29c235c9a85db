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
model, an evaluation), `save`/`load` (a sharded checkpoint: torch.distributed.checkpoint, one file per shard
and its metadata, loadable at another group size and world size) and `tensor_bytes()` (what one member holds).

A group survives the death of one member without storage through `ShardMirror`: each member keeps, in
host memory, a copy of the shard of the member before it in its group (its parameters and optimizer
state), kept current by receiving that member's reduced gradient shard every step and applying the same
update to the copy. The cost: one gradient shard sent and received a step inside the group, and one more
shard's parameters, gradients and optimizer state held.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
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
        self.inside, self.peers, self._ranked = inside, peers, ranked
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

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        """The replica's shards (parameters and optimizer state) written under `path` as a checkpoint of
        torch.distributed.checkpoint, by the members of the first replica group (each writes its shard; the
        first writes the metadata); every other group holds the same shards and writes nothing. Every
        member calls it (it returns at once outside the first group)."""
        if self.layout.group_of(self.rank) != 0:
            return
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path, process_group=self._ranked)

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        """Take the state `save` wrote, written at any group size and world size: each member reads the
        parts of the checkpoint's shards that make up its own (every member calls it; each group reads
        over its own group)."""
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path, process_group=self._ranked)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)  # loaded in place

    def close(self) -> None:
        """torch forgets the group (before the epoch's group is released)."""
        self._world.give_back()


def shard_shape(shape: Sequence[int], shard: int, shards: int) -> tuple[int, ...]:
    """The shape of shard `shard` of `shards` of a parameter of `shape`, as FSDP2 cuts it: dim 0 in chunks
    of ceil(rows / shards) (the last ones shorter, or empty)."""
    if not shape:
        return ()
    rows = shape[0]
    chunk = -(-rows // shards)
    start, end = min(shard * chunk, rows), min((shard + 1) * chunk, rows)
    return (end - start, *shape[1:])


class ShardMirror:
    """A copy of the shard held by the member before this one in its replica group (shard i - 1, the first
    member mirroring the last): its parameters, in plain tensors, and an optimizer of the model's kind and
    settings over them. Made by every member of the group at the same point, from the shards they hold
    then; kept current by `step`, after the step's gradients are final and before the optimizer steps."""

    def __init__(self, group: ShardedGroup, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.group = group
        k = group.layout.group_size
        shard = group.layout.shard_of(group.rank)
        self.source, self._next = (shard - 1) % k, (shard + 1) % k
        params = list(model.parameters())
        shapes = [shard_shape(p.shape, self.source, k) for p in params]
        self.params = [torch.nn.Parameter(torch.empty(s, dtype=p.dtype, device=local(p).device)) for s, p in zip(shapes, params)]
        self._grads = [torch.zeros_like(mine) for mine in self.params]
        for mine, grad in zip(self.params, self._grads):
            mine.grad = grad
        index = {id(p): i for i, p in enumerate(params)}
        groups = [{**{k_: v for k_, v in g.items() if k_ != "params"}, "params": [self.params[index[id(p)]] for p in g["params"]]}
                  for g in optimizer.param_groups]
        self.optimizer = type(optimizer)(groups)  # type: ignore[call-arg]  # the groups carry every setting
        self._ring([local(p).detach() for p in params], [mine.data for mine in self.params])

    def _ring(self, sends: list[torch.Tensor], into: list[torch.Tensor]) -> None:
        """Send `sends` (flat, one message) to the next member of the group and receive the previous one's into `into`."""
        if self.group.layout.group_size == 1:
            for out, value in zip(into, sends):
                out.copy_(value)
            return
        flat_out = torch.cat([t.reshape(-1) for t in sends])
        flat_in = torch.empty(sum(t.numel() for t in into), dtype=flat_out.dtype, device=flat_out.device)
        self.group.inside.exchange([(flat_out, self._next)], [(flat_in, self.source)]).wait()
        offset = 0
        for out in into:
            out.copy_(flat_in[offset:offset + out.numel()].view_as(out))
            offset += out.numel()

    def step(self, model: torch.nn.Module) -> None:
        """This step's reduced gradient shards go to the next member; the previous member's come in, and
        the copy takes the same update its owner's optimizer is about to make."""
        grads = [p.grad for p in model.parameters()]
        if any(g is None for g in grads):
            raise RuntimeError("sharding: a parameter has no gradient this step; its mirror cannot follow it")
        self._ring([local(g) for g in grads if g is not None], self._grads)
        self.optimizer.step()

    def state(self) -> tuple[list[torch.Tensor], list[dict]]:
        """The mirrored shard: its parameters, and the optimizer's state for each (in parameter order)."""
        return [p.detach() for p in self.params], [self.optimizer.state.get(p, {}) for p in self.params]

    def tensor_bytes(self) -> int:
        """What the copy costs in memory: parameters, the received gradients and the optimizer's state."""
        return tensor_bytes(torch.nn.ParameterList(self.params), self.optimizer).total
