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

A new membership epoch re-cuts the replica from what the members hold (`reshard`): each member's new shard
is assembled from the rows of the old shards that cover it, taken from itself or sent by a member that
holds them (its own shard, a peer's in another group, or a mirror of a departed member's), one message
per pair of members and no whole-state buffer anywhere; `adopt` then builds the model over the new group
from those shards alone (never materializing the whole model) with the optimizer's state restored.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
from torch.optim.adam import adam as adam_update
from torch.utils._pytree import tree_map

from actors.training.state_transfer import flat_bytes
from actors.transport import torch_world
from algorithms.rules.sharding import (
    HeldView,
    LayoutError,
    Recut,
    RowMove,
    ShardLayout,
    group_size_for,
    plan_recut,
    reshard_moves,
    row_range,
)
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
        self._writer: dist.ProcessGroup | None = None
        """The first replica group's group for checkpoints written in the background (`save`)."""
        device = getattr(inside, "device", torch.device("cpu")).type
        self._backend = "nccl" if device == "cuda" else "gloo"
        """torch's name for the backend of this group's process groups (for its bookkeeping)."""
        self._world = torch_world.lend(ranked, self._backend)
        # named after its group: torch's DTensor caches its plans by mesh, and meshes compare equal by their
        # ranks, device and names, so an unnamed mesh of a later epoch's group of the same ranks would run
        # the cached plan of an earlier epoch's (over that epoch's released group)
        self.mesh = DeviceMesh.from_group(ranked, device, mesh_dim_names=(ranked.group_name,))

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

    def gathered(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(the model's state, the optimizer's `state_dict`) whole, as an unsharded model's and optimizer's
        are: every parameter and every moment gathered over the group, in one order on every member (each
        member of the group calls it). Costs a whole replica's state in memory while it is held."""
        return self.full_state(model), tree_map(lambda v: v.full_tensor() if isinstance(v, DTensor) else v,
                                                optimizer.state_dict())

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str,
             background: bool = False) -> Future[None] | None:
        """The replica's shards (parameters and optimizer state) written under `path` as a checkpoint of
        torch.distributed.checkpoint, by the members of the first replica group (each writes its shard; the
        first writes the metadata); every other group holds the same shards and writes nothing. Every
        member calls it (it returns at once outside the first group).

        `background`: the shards are copied now (training may go on past them) and written by a thread,
        over a group of the first replica group's own (formed at the first such save): the future is done
        once written. Otherwise written before it returns."""
        if self.layout.group_of(self.rank) != 0:
            return None
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        if not background:
            dcp.save(state, checkpoint_id=path, process_group=self._ranked)
            return None
        if self._writer is None:
            writer = self.comm.subgroup(self.layout.group_ranks(self.rank), "replica-0-checkpoints")
            ranked = writer.ranked_group() if writer is not None else None
            if ranked is None:
                raise RuntimeError(f"sharding: the {type(self.comm).__name__} group forms no group for checkpoints")
            self._writer = ranked
        snapshot = tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, state)
        done: Future[None] = Future()
        group = self._writer

        def write() -> None:
            world = torch_world.borrow(group, self._backend)
            try:
                dcp.save(snapshot, checkpoint_id=path, process_group=group)
                done.set_result(None)
            except BaseException as err:  # noqa: BLE001 - the caller's future raises it
                done.set_exception(err)
            finally:
                world.give_back()

        threading.Thread(target=write, name=f"sharded checkpoint {path}", daemon=True).start()
        return done

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        """Take the state `save` wrote, written at any group size and world size: each member reads the
        parts of the checkpoint's shards that make up its own (every member calls it; each group reads
        over its own group)."""
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path, process_group=self._ranked)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)  # loaded in place

    def close(self) -> None:
        """torch forgets the group (before the epoch's group is released), and DTensor's redistribution plans
        made over its mesh (which hold it)."""
        self._world.give_back()
        clear_redistribute_planner_cache()


def shard_shape(shape: Sequence[int], shard: int, shards: int) -> tuple[int, ...]:
    """The shape of shard `shard` of `shards` of a parameter of `shape`, as FSDP2 cuts it (`row_range`)."""
    if not shape:
        return ()
    start, end = row_range(shape[0], shard, shards)
    return (end - start, *shape[1:])


def pack(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after the other, in one flat uint8 tensor (one message)."""
    parts = [flat_bytes(t) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(data: torch.Tensor, templates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`pack`'s message read back as tensors of the templates' shapes and dtypes (views where aligned)."""
    values, offset = [], 0
    for template in templates:
        size = template.numel() * template.element_size()
        raw = data[offset:offset + size]
        if offset % template.element_size():  # a view needs its dtype's alignment: after 4-byte rows, an 8-byte count
            raw = raw.clone()
        values.append(raw.view(template.dtype).view(template.shape))
        offset += size
    return values


def message_bytes(templates: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in templates)


KINDS = ("exp_avg", "exp_avg_sq")
"""AdamW's state with a row per parameter row (SGD's would be momentum_buffer)."""
COUNTS = ("step",)
"""AdamW's 0-d state."""


class ShardMirror:
    """A copy of the shard held by the member before this one in its replica group (shard i - 1, the first
    member mirroring the last): its parameters, in plain tensors, and an optimizer of the model's kind and
    settings over them. Made by every member of the group at the same point, from the shards they hold
    then; kept current by `step`, after the step's gradients are final and before the optimizer steps."""

    def __init__(self, group: ShardedGroup, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 kinds: Sequence[str] = KINDS, counts: Sequence[str] = COUNTS) -> None:
        """`kinds`/`counts`: the optimizer's state per parameter row and its 0-d state, which the copy takes
        from its owner as it is now (none yet before the first step)."""
        self.group = group
        k = group.layout.group_size
        if k == 1:
            raise ValueError("sharding: a replica group of one has no neighbour to mirror")
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
        stepped = any(optimizer.state.get(p) for p in params)
        sends = [local(p).detach() for p in params]
        into = [mine.data for mine in self.params]
        if stepped:  # the owner's moments and count come along: the copy's next update is the owner's
            sends += [local(optimizer.state[p][c]).reshape(1).to(torch.float64) for p in params for c in counts]
            sends += [local(optimizer.state[p][kind]) for p in params for kind in kinds]
            into += [torch.empty(1, dtype=torch.float64) for _ in params for _ in counts]
            into += [torch.empty_like(mine) for mine in self.params for _ in kinds]
        self._ring(sends, into)
        if stepped:
            n = len(params)
            received = into[n:]
            steps, moments = received[:n * len(counts)], received[n * len(counts):]
            for i, mine in enumerate(self.params):
                state = {c: steps[i * len(counts) + j].reshape(()).to(_count_dtype()) for j, c in enumerate(counts)}
                state.update({kind: moments[i * len(kinds) + j] for j, kind in enumerate(kinds)})
                self.optimizer.state[mine] = state

    def _ring(self, sends: list[torch.Tensor], into: list[torch.Tensor]) -> None:
        """Send `sends` (one message) to the next member of the group and receive the previous one's into `into`."""
        incoming = torch.empty(message_bytes(into), dtype=torch.uint8)
        self.group.inside.exchange([(pack(sends), self._next)], [(incoming, self.source)]).wait()
        for out, value in zip(into, unpack(incoming, into)):
            out.copy_(value)

    def step(self, model: torch.nn.Module) -> None:
        """This step's reduced gradient shards go to the next member; the previous member's come in, and
        the copy takes the same update its owner's optimizer is about to make (`receive`, then `update`)."""
        self.receive(model)
        self.update()

    def receive(self, model: torch.nn.Module) -> None:
        """This step's reduced gradient shards go to the next member and the previous member's come in (the
        step's one collective of the mirror: where it fails, the step fails and the copy stays as it was)."""
        grads = [p.grad for p in model.parameters()]
        if any(g is None for g in grads):
            raise RuntimeError("sharding: a parameter has no gradient this step; its mirror cannot follow it")
        self._ring([local(g) for g in grads if g is not None], self._grads)

    def update(self, lr: float | None = None) -> None:
        """The copy takes the update its owner makes with the gradients `receive` brought (at `lr`, the
        step's learning rate, where the owner's is set per step)."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()

    def state(self) -> tuple[list[torch.Tensor], list[dict]]:
        """The mirrored shard: its parameters, and the optimizer's state for each (in parameter order)."""
        return [p.detach() for p in self.params], [self.optimizer.state.get(p, {}) for p in self.params]

    def tensor_bytes(self) -> int:
        """What the copy costs in memory: parameters, the received gradients and the optimizer's state."""
        return tensor_bytes(torch.nn.ParameterList(self.params), self.optimizer).total


@dataclass
class HeldShard:
    """An old shard a member holds: the local tensors of every parameter (in the model's order) and the
    optimizer's state for each (tensors: a moment per row, or a 0-d count)."""

    index: int
    params: list[torch.Tensor]
    states: list[dict[str, torch.Tensor]]


def held_shards(group: ShardedGroup, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                mirror: ShardMirror | None = None, params: Sequence[torch.Tensor] | None = None) -> list[HeldShard]:
    """What this member holds of its replica: its own shard and, with a mirror, its neighbour's. `params`: the
    sharded parameters, where `model.parameters()` may not give them (a forward that failed part-way leaves
    FSDP's whole parameters on the modules)."""
    params = list(model.parameters()) if params is None else list(params)
    held = [HeldShard(group.layout.shard_of(group.rank), [local(p).detach() for p in params],
                      [{k: local(v) for k, v in optimizer.state.get(p, {}).items()} for p in params])]
    if mirror is not None:
        copies, states = mirror.state()
        held.append(HeldShard(mirror.source, copies, [dict(st) for st in states]))
    return held


def agree_on_recut(comm: Communicator, mine: HeldView) -> tuple[Recut | None, list[HeldView]]:
    """Every member of a new epoch tells the others what it holds (one all-gather of a few integers) and
    all decide alike where they stand (`plan_recut`); also returns every member's view, in rank order."""
    values = torch.tensor(mine.encode(), dtype=torch.int64)
    outputs = [torch.empty_like(values) for _ in range(comm.world_size)]
    comm.all_gather(outputs, values).wait()
    views = [HeldView.decode(out.tolist()) for out in outputs]
    return plan_recut(views), views


def reshard(comm: Communicator, old_group_size: int, new: ShardLayout, holders: Sequence[Sequence[int]],
            held: Sequence[HeldShard], shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype],
            kinds: Sequence[str] = KINDS, counts: Sequence[str] = COUNTS) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """This member's shard under `new` (the new epoch's layout, `comm` its group): for every parameter
    (whole shape `shapes[i]`, dtype `dtypes[i]`) its rows, the optimizer's `kinds` for those rows (state
    tensors with a row per parameter row and the parameter's dtype: AdamW's exp_avg and exp_avg_sq) and its
    0-d `counts` (AdamW's step: float64 here, `adopt` casts them). `holders[j]`: the ranks holding old shard
    j; `held`: what this member holds. Every member of the new epoch calls it at the same point."""
    rank = comm.rank
    mine = {h.index: h for h in held}
    moves = [(i, m) for i, shape in enumerate(shapes) for m in reshard_moves(shape[0], old_group_size, new, holders)]
    shard = new.shard_of(rank)
    spans = [row_range(shape[0], shard, new.group_size) for shape in shapes]
    params = [torch.empty((hi - lo, *shape[1:]), dtype=dtype) for (lo, hi), shape, dtype in zip(spans, shapes, dtypes)]
    states: list[dict[str, torch.Tensor]] = [{k: torch.zeros_like(p) for k in kinds} for p in params]
    scalars: list[dict[str, torch.Tensor]] = [{} for _ in params]

    def pieces(i: int, move: RowMove) -> list[torch.Tensor]:
        """The tensors `move` carries, from the holder's old shard: the counts, then the rows of the
        parameter and of each kind."""
        old = mine[move.old_shard]
        first = row_range(shapes[i][0], move.old_shard, old_group_size)[0]
        lo, hi = move.rows[0] - first, move.rows[1] - first
        state = old.states[i]
        zero_d = [state[c].to(torch.float64).reshape(()) if c in state else torch.zeros((), dtype=torch.float64) for c in counts]
        return [*zero_d, old.params[i][lo:hi], *(state[k][lo:hi] if k in state else torch.zeros_like(old.params[i][lo:hi])
                                                 for k in kinds)]

    def templates(i: int, move: RowMove) -> list[torch.Tensor]:
        """What `pieces` sends for `move`, as empty tensors of its shapes and dtypes (the receiver's side)."""
        n = move.rows[1] - move.rows[0]
        return [torch.empty((), dtype=torch.float64) for _ in counts] + [params[i][:n]] + [states[i][k][:n] for k in kinds]

    def place(i: int, move: RowMove, values: list[torch.Tensor]) -> None:
        lo, hi = move.rows[0] - spans[i][0], move.rows[1] - spans[i][0]
        scalars[i].update({c: v.clone() for c, v in zip(counts, values)})
        rows = values[len(counts):]
        params[i][lo:hi].copy_(rows[0])
        for k, value in zip(kinds, rows[1:]):
            states[i][k][lo:hi].copy_(value)

    outgoing: dict[int, list[torch.Tensor]] = {}
    incoming: dict[int, list[tuple[int, RowMove, list[torch.Tensor]]]] = {}
    for i, move in moves:
        if move.source == rank and move.target == rank:
            place(i, move, pieces(i, move))
        elif move.source == rank:
            outgoing.setdefault(move.target, []).extend(pieces(i, move))
        elif move.target == rank:
            incoming.setdefault(move.source, []).append((i, move, templates(i, move)))
    expected = {src: [t for _, _, shapes_of in received for t in shapes_of] for src, received in incoming.items()}
    buffers = {src: torch.empty(message_bytes(shapes_of), dtype=torch.uint8) for src, shapes_of in expected.items()}
    if outgoing or buffers:  # one message per pair of members, all at once (no ring of sends can deadlock)
        comm.exchange([(pack(parts), dst) for dst, parts in outgoing.items()],
                      [(buf, src) for src, buf in buffers.items()]).wait()
    for src, received in incoming.items():
        values = unpack(buffers[src], expected[src])
        for i, move, shapes_of in received:
            place(i, move, values[:len(shapes_of)])
            values = values[len(shapes_of):]
    return params, [{**scalars[i], **states[i]} for i in range(len(params))]


@torch.no_grad()
def step_on_shards(optimizer: torch.optim.Adam, closure: Callable[[], float] | None = None) -> None:
    """`optimizer.step()` (Adam, AdamW) on each shard's local tensors rather than on FSDP's DTensors: the
    same arithmetic (torch's own `adam` function on the same tensors' storage: each member's update is
    elementwise on its shard), without DTensor's dispatch, whose sharding rules are worked out afresh for
    every new epoch's mesh (a new epoch's first update took 0.2-0.4 s against 0.05 on the tiny GPT). The
    state is made, and kept, as the optimizer keeps it (DTensors whose local tensors the update writes)."""
    if closure is not None:
        raise ValueError("sharding: the optimizer's step takes no closure")
    for group in optimizer.param_groups:
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        max_exp_avg_sqs: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        has_complex = optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam_update([local(p) for p in params], [local(g) for g in grads], [local(m) for m in exp_avgs],
                    [local(v) for v in exp_avg_sqs], [local(v) for v in max_exp_avg_sqs], steps,
                    amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                    foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                    fused=group["fused"], grad_scale=None, found_inf=None,
                    decoupled_weight_decay=group["decoupled_weight_decay"])


def adopt(group: ShardedGroup, build: Callable[[], torch.nn.Module], params: Sequence[torch.Tensor],
          states: Sequence[dict[str, torch.Tensor]], make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
          buffers: dict[str, torch.Tensor] | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer over `group` from this member's shards alone: the model built on the meta
    device (no whole parameter is ever allocated), sharded, given memory for its shards and filled with
    `params`; the optimizer made by `make_optimizer` (of the sharded model: its parameter groups as the
    model's names and modules say) and given `states`; `buffers` (unsharded) copied in."""
    with torch.device("meta"):
        model = build()
    group.shard(model)
    model.to_empty(device=getattr(group.inside, "device", torch.device("cpu")))
    mine = list(model.parameters())
    with torch.no_grad():
        for p, value in zip(mine, params):
            local(p).copy_(value)
        for name, value in (buffers or {}).items():
            model.get_buffer(name).copy_(value)
    optimizer = make_optimizer(model)
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):  # their step on the shards' local tensors
        optimizer.step = functools.partial(step_on_shards, cast(torch.optim.Adam, optimizer))  # type: ignore[method-assign, assignment]
    for p, state in zip(mine, states):
        if state:
            assert isinstance(p, DTensor)  # every parameter is a shard after `shard`
            optimizer.state[p] = {k: v.to(_count_dtype()) if v.dim() == 0 else
                                  DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements, run_check=False,
                                                     shape=p.shape, stride=p.stride())
                                  for k, v in state.items()}
    return model, optimizer


def _count_dtype() -> torch.dtype:
    """The dtype torch's optimizers keep a 0-d count in (their step: float64 under a float64 default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@dataclass
class ShardedState:
    """One member's part of the replica in a membership epoch: its group, the model and optimizer over it
    (shards), its mirror of a neighbour's shard, and the step of the state it holds."""

    group: ShardedGroup
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    mirror: ShardMirror | None
    mark: int
    params: list[torch.Tensor]
    """The sharded parameters, as `adopt` made them (what the optimizer's state is keyed by)."""

    def held(self) -> list[HeldShard]:
        return held_shards(self.group, self.model, self.optimizer, self.mirror, self.params)

    def view(self, mark: int) -> HeldView:
        """What it holds, told at the next entry: its shards, of the committed state at step `mark` (the step
        it stands at then: `self.mark` is the step it entered at)."""
        return HeldView(mark, self.group.layout.group_size, tuple(h.index for h in self.held()))


def whole(model: torch.nn.Module, mark: int = 0,
          optimizer: torch.optim.Optimizer | None = None) -> tuple[HeldView, list[HeldShard]]:
    """What a member holds when it holds the whole replica (a fresh model, or one loaded from a checkpoint
    at step `mark`, before any epoch cut it): the one shard of a group of one, with `optimizer`'s state
    (none without one)."""
    params = list(model.parameters())
    states = [{} if optimizer is None else dict(optimizer.state.get(p, {})) for p in params]
    return HeldView(mark, 1, (0,)), [HeldShard(0, [p.detach() for p in params], states)]


NOTHING = HeldView(-1, 0, ())
"""What a joiner holds."""


def enter_epoch(comm: Communicator, group_size: int, view: HeldView, held: Sequence[HeldShard],
                build: Callable[[], torch.nn.Module],
                make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer], mirror: bool = True,
                kinds: Sequence[str] = KINDS, counts: Sequence[str] = COUNTS,
                buffers: dict[str, torch.Tensor] | None = None) -> ShardedState:
    """A member's entry into a membership epoch (`comm`: its group, every member calls it at once): the
    members agree on the newest state they hold whole, the replica is re-cut into groups of
    `group_size_for(world, group_size)` from their memory, and model and optimizer are built over the new
    group from this member's new shard alone; with `mirror`, each member then mirrors its neighbour's.
    `view`/`held`: what it holds (`ShardedState.view(mark)`/`held()`, `whole(model)` before any epoch, `NOTHING`
    for a joiner); `buffers`: the model's buffers (not sharded, not trained: a mask, positions), copied in.
    Raises LayoutError where no state is held whole any more (the newest checkpoint's turn)."""
    recut, views = agree_on_recut(comm, view)
    if recut is None:
        raise LayoutError(f"no committed state is held whole by the members of this epoch (they hold: "
                          f"{', '.join(f'step {v.mark} shards {list(v.shards)} of {v.group_size}' for v in views)})")
    layout = ShardLayout(comm.world_size, group_size_for(comm.world_size, group_size))
    with torch.device("meta"):  # the shapes and dtypes, no memory
        parameters = list(build().parameters())
    shapes, dtypes = [p.shape for p in parameters], [p.dtype for p in parameters]
    mine = [] if comm.rank in recut.replaced else list(held)
    params, states = reshard(comm, recut.old_group_size, layout, recut.holders, mine, shapes, dtypes, kinds, counts)
    if all(float(state[c]) == 0 for state in states for c in counts if c in state):
        states = [{} for _ in params]  # an optimizer that never stepped (a fresh model): it starts fresh
    group = ShardedGroup(comm, layout, comm.rank)
    try:
        model, optimizer = adopt(group, build, params, states, make_optimizer, buffers)
        copy = ShardMirror(group, model, optimizer, kinds, counts) if mirror and layout.group_size > 1 else None
    except BaseException:
        group.close()  # torch forgets the group it was lent (the group itself failed, or is about to be left)
        raise
    return ShardedState(group, model, optimizer, copy, recut.mark, list(model.parameters()))
