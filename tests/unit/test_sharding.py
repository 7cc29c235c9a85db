"""Sharded replica groups (actors/training/sharding.py): torch's FSDP inside each replica group over the
project's own gloo groups, the shards summed across groups. Four members in threads of this process
(each with its own torch world), on a small GPT, against one process training the same global batches
with AdamW: the reference is the plain model and optimizer, nothing of the sharding's."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from actors.training.sharding import (
    NOTHING,
    HeldShard,
    ShardedGroup,
    ShardedState,
    ShardMirror,
    adopt,
    agree_on_recut,
    enter_epoch,
    held_shards,
    local,
    reshard,
    tensor_bytes,
    whole,
)
from actors.transport import torch_world
from actors.transport.factory import in_process_group
from algorithms.policies.optim import build_optimizer
from algorithms.rules.sharding import HeldView, LayoutError, ShardLayout, plan_recut, reshard_moves, row_range
from core.schema import OptimizerConfig, parse
from orchestrator.workloads.lm import GPT, GPTConfig

WORLD, STEPS, ROWS, SEQ = 4, 20, 2, 16
CONFIG = GPTConfig(d_model=32, n_layer=2, n_head=2, seq_len=SEQ, vocab=64)


def test_the_layout_cuts_consecutive_ranks_into_groups_and_pairs_each_shard_across_them():
    layout = ShardLayout(6, 3)
    assert layout.groups == 2
    assert [layout.group_ranks(r) for r in (0, 4)] == [(0, 1, 2), (3, 4, 5)]
    assert [layout.peer_ranks(r) for r in (0, 4, 5)] == [(0, 3), (1, 4), (2, 5)]
    assert ShardLayout(4, 1).peer_ranks(2) == (0, 1, 2, 3) and ShardLayout(4, 4).peer_ranks(2) == (2,)
    with pytest.raises(LayoutError, match="multiple of sharding.group_size"):
        ShardLayout(3, 2)


def test_a_recut_takes_every_row_once_from_a_holder_preferring_itself():
    """10 rows cut 4 ways (3, 3, 3, 1) re-cut 3 ways (4, 4, 2); old shard 2 is held only by rank 2 (a
    mirror), old shard 0 by ranks 0 and 1."""
    assert [row_range(10, j, 4) for j in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [row_range(2, j, 4) for j in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    moves = reshard_moves(10, 4, ShardLayout(3, 3), [[0, 1], [1], [2], [2, 0]])
    assert [(m.source, m.target, m.old_shard, m.rows) for m in moves] == [
        (0, 0, 0, (0, 3)), (1, 0, 1, (3, 4)),
        (1, 1, 1, (4, 6)), (2, 1, 2, (6, 8)),
        (2, 2, 2, (8, 9)), (2, 2, 3, (9, 10))]
    for target in range(3):
        covered = sorted(m.rows for m in moves if m.target == target)
        assert covered[0][0] == row_range(10, target, 3)[0] and covered[-1][1] == row_range(10, target, 3)[1]
    with pytest.raises(LayoutError, match=r"old shards \[1\] are held by no member"):
        reshard_moves(10, 2, ShardLayout(2, 2), [[0], []])


def test_the_members_stand_at_the_newest_state_some_member_holds_whole():
    """Members one step apart (a vote that finished on some): the newest step wins where its shards are all
    held, else the one before; none held whole is None (the newest checkpoint's turn)."""
    v = HeldView
    assert HeldView.decode(v(7, 4, (2, 1)).encode()) == v(7, 4, (2, 1)) and v(-1, 0, ()).encode() == [-1, 0, -1, -1]
    recut = plan_recut([v(8, 2, (0,)), v(8, 2, (1, 0)), v(7, 2, (0, 1)), v(-1, 0, ())])
    assert recut is not None and (recut.mark, recut.old_group_size, recut.holders, recut.replaced) == (8, 2, ((0, 1), (1,)), (2, 3))
    recut = plan_recut([v(8, 2, (0,)), v(7, 2, (1, 0)), v(7, 2, (0, 1))])
    assert recut is not None and (recut.mark, recut.holders, recut.replaced) == (7, ((1, 2), (1, 2)), (0,))
    assert plan_recut([v(5, 4, (0, 3)), v(5, 4, (1, 0)), v(5, 4, (3,))]) is None
    with pytest.raises(ValueError, match="one layout per step"):
        plan_recut([v(5, 4, (0,)), v(5, 2, (1,))])


def batches(steps: int, rows: int = WORLD * ROWS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, CONFIG.vocab, (rows, SEQ + 1), generator=g) for _ in range(steps)]


def loss_of(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def sgd(params) -> torch.optim.Optimizer:
    """Not scale-invariant, as Adam nearly is: a gradient divided twice shows."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference(initial: dict, data: list[torch.Tensor], dtype: torch.dtype, optimizer=adamw,
              of_model=None) -> dict[str, torch.Tensor]:
    """One process: the model on each whole global batch (`optimizer` of its parameters, or `of_model` of
    the model)."""
    model = GPT(CONFIG).to(dtype)
    model.load_state_dict(initial)
    opt = of_model(model) if of_model is not None else optimizer(model.parameters())
    for rows in data:
        opt.zero_grad()
        loss_of(model, rows).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharded(group_size: int, initial: dict, data: list[torch.Tensor], dtype: torch.dtype,
            across: bool = True, divide: bool = False, optimizer=adamw, mirror: str = "") -> list[dict]:
    """Four members, `group_size` to a replica; each trains its share of every global batch (its loss
    weighted by its share, as the project's members do). `across`/`divide`: the mechanisms, switchable;
    `mirror`: "on" keeps a `ShardMirror`, "frozen" makes one and never steps it."""
    def member(rank: int, comm) -> dict:
        group = ShardedGroup(comm, ShardLayout(WORLD, group_size), rank)
        try:
            model = GPT(CONFIG).to(dtype)
            model.load_state_dict(initial)
            group.shard(model)
            if divide:  # FSDP's default: the group's sum divided by its size
                for module in model.modules():
                    if hasattr(module, "set_gradient_divide_factor"):
                        module.set_gradient_divide_factor(float(group_size))
            opt = optimizer(model.parameters())
            copy = ShardMirror(group, model, opt) if mirror else None
            tails = []
            for rows in data:
                opt.zero_grad()
                mine = rows[rank * ROWS:(rank + 1) * ROWS]
                (loss_of(model, mine) * (ROWS / len(rows))).backward()
                tail = torch.tensor([0.0, float(ROWS), 0.0], dtype=torch.float64)
                if across:
                    tails.append(group.reduce_across(model, tail))
                if copy is not None and mirror == "on":
                    copy.step(model)
                opt.step()
            state = group.full_state(model)
            shards = [local(p).detach().clone() for p in model.parameters()]
            moments = [{k: local(v).clone() for k, v in opt.state[p].items()} for p in model.parameters()]
            return {"state": {k: v.detach().clone() for k, v in state.items()}, "tails": tails,
                    "bytes": tensor_bytes(model, opt), "shards": shards, "moments": moments,
                    "mirror": copy.state() if copy is not None else None,
                    "mirror_bytes": copy.tensor_bytes() if copy is not None else 0}
        finally:
            group.close()

    return run_members(WORLD, f"sharding-{group_size}-{dtype}-{across}-{divide}-{optimizer.__name__}", member)


def largest_difference(state: dict, ref: dict) -> float:
    return max(float((state[k].to(torch.float64) - ref[k].to(torch.float64)).abs().max()) for k in ref)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_bsp_over_sharded_groups_equals_one_process_on_the_same_global_batches(group_size, dtype, tolerance):
    torch.manual_seed(0)
    initial = GPT(CONFIG).to(dtype).state_dict()
    data = batches(STEPS)
    ref = reference(initial, data, dtype)
    members = sharded(group_size, initial, data, dtype)
    for rank, member in enumerate(members):
        assert largest_difference(member["state"], ref) <= tolerance, (rank, largest_difference(member["state"], ref))
        assert all(int(t[1]) == WORLD * ROWS for t in member["tails"]), "the vote's tail sums every member's samples"
    full = sum(p.numel() * p.element_size() for p in GPT(CONFIG).to(dtype).parameters())
    held = members[0]["bytes"]
    # each member holds 1/k of the parameters (FSDP pads each to a multiple of k rows: a few bytes over)
    assert held.parameters <= full / group_size * 1.05 + 1024, (held, full)
    assert held.optimizer <= 2 * full / group_size * 1.05 + 2048, (held, full)


@pytest.mark.parametrize("switched_off", ["across", "divide"])
def test_each_part_of_the_reduction_is_needed(switched_off):
    """The test above fails with either part off: no sum across groups (each group trains on its own
    half), or FSDP's division by the group's size (the gradients already weighted). With SGD: Adam
    nearly undoes a gradient's scale."""
    torch.manual_seed(0)
    dtype = torch.float64
    initial = GPT(CONFIG).to(dtype).state_dict()
    data = batches(4)
    ref = reference(initial, data, dtype, sgd)
    assert largest_difference(sharded(2, initial, data, dtype, optimizer=sgd)[0]["state"], ref) <= 1e-12
    members = sharded(2, initial, data, dtype, across=switched_off != "across", divide=switched_off == "divide",
                      optimizer=sgd)
    assert largest_difference(members[0]["state"], ref) > 1e-4


@pytest.mark.parametrize("group_size", [2, 4])
def test_each_member_mirrors_the_previous_members_shard_bit_for_bit(group_size):
    """Every member's copy of the shard before its own in the group (kept by applying that member's
    reduced gradient shard each step) equals that member's parameters and AdamW moments exactly, and costs
    about one more shard; the copy that is never stepped does not."""
    torch.manual_seed(0)
    dtype = torch.float32
    initial = GPT(CONFIG).to(dtype).state_dict()
    data = batches(10)
    members = sharded(group_size, initial, data, dtype, mirror="on")
    for rank, member in enumerate(members):
        first = rank - rank % group_size
        source = members[first + (rank - first - 1) % group_size]
        params, moments = member["mirror"]
        assert all(torch.equal(a, b) for a, b in zip(params, source["shards"])), rank
        assert all(set(m) == set(s) and all(torch.equal(m[k].reshape(-1), s[k].reshape(-1)) for k in m)
                   for m, s in zip(moments, source["moments"])), rank
        assert member["mirror_bytes"] <= member["bytes"].total * 1.05 + 4096, (member["mirror_bytes"], member["bytes"])
    frozen = sharded(group_size, initial, data, dtype, mirror="frozen")
    assert not all(torch.equal(a, b) for a, b in zip(frozen[1]["mirror"][0], frozen[0]["shards"]))


def test_a_sharded_checkpoint_resumes_at_another_group_size_and_world_size(tmp_path):
    """Written at 4 workers in groups of 2 after 5 steps; resumed at 3 workers in groups of 1 (and at 4 in
    one group of 4), the next 5 steps equal 10 steps straight through; a resume that loads nothing does not."""
    torch.manual_seed(0)
    dtype = torch.float64
    initial = GPT(CONFIG).to(dtype).state_dict()
    data = batches(10, rows=12)
    path = str(tmp_path / "step-5")
    straight = reference(initial, data, dtype)
    written = resumed(4, 2, initial, data[:5], dtype, save=path)
    assert largest_difference(written, reference(initial, data[:5], dtype)) <= 1e-12
    assert sorted(p.name for p in tmp_path.joinpath("step-5").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for world, k in ((3, 1), (4, 4)):
        assert largest_difference(resumed(world, k, initial, data[5:], dtype, load=path), straight) <= 1e-12, (world, k)
    assert largest_difference(resumed(3, 1, initial, data[5:], dtype), straight) > 1e-4


def resumed(world: int, group_size: int, initial: dict, data: list[torch.Tensor], dtype: torch.dtype,
            load: str | None = None, save: str | None = None) -> dict:
    """`world` members in groups of `group_size`, each on its equal share of every global batch, from
    `initial` or the checkpoint `load`; `save`: written at the end. Returns rank 0's whole state."""
    def member(rank: int, comm) -> dict:
        group = ShardedGroup(comm, ShardLayout(world, group_size), rank)
        try:
            model = GPT(CONFIG).to(dtype)
            model.load_state_dict(initial)
            group.shard(model)
            opt = adamw(model.parameters())
            if load:
                group.load(model, opt, load)
            for rows in data:
                opt.zero_grad()
                share = len(rows) // world
                (loss_of(model, rows[rank * share:(rank + 1) * share]) * (share / len(rows))).backward()
                group.reduce_across(model)
                opt.step()
            if save:
                group.save(model, opt, save)
            return {k: v.detach().clone() for k, v in group.full_state(model).items()}
        finally:
            group.close()

    return run_members(world, f"dcp-{world}-{group_size}-{load}-{save}", member)[0]


KINDS = ("exp_avg", "exp_avg_sq")


def train_shares(model, opt, group, rank: int, world: int, data: list[torch.Tensor], mirror=None) -> None:
    for rows in data:
        opt.zero_grad()
        share = len(rows) // world
        (loss_of(model, rows[rank * share:(rank + 1) * share]) * (share / len(rows))).backward()
        group.reduce_across(model)
        if mirror is not None:
            mirror.step(model)
        opt.step()


def run_members(world: int, name: str, member) -> list:
    """`member(rank, comm)` for each rank of a `world`-member gloo group named `name`, in threads of this
    process, each with its own torch world; the results in rank order."""
    torch_world.per_thread()
    comms = in_process_group(world, name=name, timeout_s=60)
    try:
        with ThreadPoolExecutor(world) as pool, torch.autograd.set_multithreading_enabled(False):
            return list(pool.map(lambda rank: member(rank, comms[rank]), range(world)))
    finally:
        for comm in comms:
            comm.close()


def before_the_death(group_size: int, initial: dict, data: list[torch.Tensor], dtype: torch.dtype, mirrors: bool,
                     name: str) -> list[list[HeldShard]]:
    """Four members train `data` in groups of `group_size` (with mirrors or not); what each then holds."""
    def member(rank, comm):
        group = ShardedGroup(comm, ShardLayout(WORLD, group_size), rank)
        try:
            model = GPT(CONFIG).to(dtype)
            model.load_state_dict(initial)
            group.shard(model)
            opt = adamw(model.parameters())
            mirror = ShardMirror(group, model, opt) if mirrors else None
            train_shares(model, opt, group, rank, WORLD, data, mirror)
            return [HeldShard(h.index, [p.clone() for p in h.params], [{k: v.clone() for k, v in st.items()} for st in h.states])
                    for h in held_shards(group, model, opt, mirror)]
        finally:
            group.close()
    return run_members(WORLD, name, member)


def after_the_death(holdings: list[list[HeldShard]], old_group_size: int, new_group_size: int, dtype: torch.dtype,
                    data: list[torch.Tensor], name: str, mark: int = 3) -> dict:
    """The new epoch's members (`holdings[r]`: what new rank r holds at step `mark`; [] for a joiner)
    agree where they stand, re-cut the replica from memory into groups of `new_group_size`, rebuild model
    and optimizer from their shards alone and train `data`; rank 0's whole state."""
    world = len(holdings)
    shapes = [p.shape for p in GPT(CONFIG).parameters()]

    def member(rank, comm):
        layout = ShardLayout(world, new_group_size)
        held = holdings[rank]
        mine = HeldView(mark, old_group_size, tuple(h.index for h in held)) if held else HeldView(-1, 0, ())
        recut, _ = agree_on_recut(comm, mine)
        if recut is None:
            raise LayoutError("no committed state is held whole")
        assert recut.mark == mark and recut.replaced == tuple(r for r, h in enumerate(holdings) if not h)
        params, states = reshard(comm, recut.old_group_size, layout, recut.holders, held, shapes, [dtype] * len(shapes), KINDS)
        group = ShardedGroup(comm, layout, rank)
        try:
            model, opt = adopt(group, lambda: GPT(CONFIG).to(dtype), params, states, lambda m: adamw(m.parameters()))
            train_shares(model, opt, group, rank, world, data)
            return {k: v.detach().clone() for k, v in group.full_state(model).items()}
        finally:
            group.close()
    return run_members(world, name, member)[0]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_one_group_of_four_loses_a_member_and_goes_on_from_its_members_memory(dtype, tolerance):
    """Member 2 of one group of four dies after 3 steps; the three survivors re-cut the replica three ways
    from what they hold (the lost shard from member 3's mirror of it), build model and optimizer from their
    shards alone, and the next 3 steps equal 6 straight through; without the mirrors the shard is gone.
    (float32: the messages mix 4-byte rows and 8-byte counts.)"""
    torch.manual_seed(0)
    initial = GPT(CONFIG).to(dtype).state_dict()
    data = batches(6, rows=12)
    held = before_the_death(4, initial, data[:3], dtype, mirrors=True, name=f"death-mirrored-{dtype}")
    survivors = [held[0], held[1], held[3]]
    assert {h.index for h in held[3]} == {3, 2}, "member 3 mirrors member 2's shard"
    after = after_the_death(survivors, 4, 3, dtype, data[3:], f"after-mirrored-{dtype}")
    assert largest_difference(after, reference(initial, data, dtype)) <= tolerance
    if dtype == torch.float32:
        return
    unmirrored = before_the_death(4, initial, data[:3], dtype, mirrors=False, name="death-unmirrored")
    with pytest.raises(LayoutError, match="no committed state is held whole"):
        after_the_death([unmirrored[0], unmirrored[1], unmirrored[3]], 4, 3, dtype, data[3:], "after-unmirrored")


def test_a_replacement_takes_its_shard_from_the_live_group():
    """Two groups of two; member 1 dies and a new member takes its place: it receives shard 1 from member 3
    (the other group's holder of it), builds its model from that shard alone, and the next 3 steps equal 6
    straight through."""
    torch.manual_seed(0)
    dtype = torch.float64
    initial = GPT(CONFIG).to(dtype).state_dict()
    data = batches(6, rows=12)
    held = before_the_death(2, initial, data[:3], dtype, mirrors=False, name="replace")
    after = after_the_death([held[0], [], held[2], held[3]], 2, 2, dtype, data[3:], "replaced")
    assert largest_difference(after, reference(initial, data, dtype)) <= 1e-12


@pytest.mark.parametrize("groups", ["one", "weight decay groups"])
def test_the_replica_lives_through_deaths_and_joins_from_its_members_memory_alone(groups):
    """Four members in groups of two, with mirrors. Member b dies: the three others go on as one group of
    three. Then member c dies: the two left go on as a group of two, the shard it held taken from the mirror
    made in the group of three (its AdamW moments with it). Then two members join: two groups of two again.
    Every epoch enters from the members' memory alone (no file is written or read), and the 12 steps equal
    one process's 12 on the same global batches. With the project's own optimizer factory too (AdamW's
    no-decay groups by the model's names and modules, found on the sharded model as on the whole one)."""
    torch.manual_seed(0)
    dtype = torch.float64
    initial = GPT(CONFIG).to(dtype).state_dict()
    data = batches(12, rows=12)

    def build() -> torch.nn.Module:
        return GPT(CONFIG).to(dtype)

    def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        if groups == "one":
            return adamw(model.parameters())
        return build_optimizer(model, parse(OptimizerConfig, {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1}))

    states: dict[str, ShardedState | None] = {}
    epochs = [("abcd", data[0:3]), ("acd", data[3:6]), ("ad", data[6:9]), ("aedf", data[9:12])]
    for number, (members, steps) in enumerate(epochs):
        def member(rank, comm, members=members, steps=steps, number=number):
            name = members[rank]
            previous = states.get(name)
            if number == 0:
                model = build()
                model.load_state_dict(initial)
                view, held = whole(model)
            elif previous is None:
                view, held = NOTHING, []
            else:
                view, held = previous.view(previous.mark), previous.held()
            state = enter_epoch(comm, 2, view, held, build, make_optimizer)
            train_shares(state.model, state.optimizer, state.group, rank, len(members), steps, state.mirror)
            state.mark += len(steps)
            result = {k: v.detach().clone() for k, v in state.group.full_state(state.model).items()}
            state.group.close()
            return name, state, result

        results = run_members(len(members), f"elastic-{number}", member)
        states = {name: state for name, state, _ in results}
        assert [s.group.layout.group_size for s in states.values()] == [{4: 2, 3: 3, 2: 2}[len(members)]] * len(members)
        if number == 1:  # in the group of three (a, c, d): d mirrors c's shard 1, a mirrors d's shard 2
            assert [{h.index for h in states[m].held()} for m in "acd"] == [{0, 2}, {1, 0}, {2, 1}]
    final = results[0][2]
    assert largest_difference(final, reference(initial, data, dtype, of_model=make_optimizer)) <= 1e-12


def test_a_checkpoint_written_in_the_background_holds_the_step_it_was_taken_at(tmp_path):
    """Four members in groups of two take a checkpoint after 3 steps and train 3 more while the first
    group writes it from a thread (over a group of its own); the checkpoint, loaded at 2 workers in groups
    of one, holds step 3's state exactly, and the training went on as it would have without it."""
    torch.manual_seed(0)
    dtype = torch.float64
    initial = GPT(CONFIG).to(dtype).state_dict()
    data = batches(6, rows=12)
    path = str(tmp_path / "step-3")

    def member(rank, comm):
        group = ShardedGroup(comm, ShardLayout(WORLD, 2), rank)
        try:
            model = GPT(CONFIG).to(dtype)
            model.load_state_dict(initial)
            group.shard(model)
            opt = adamw(model.parameters())
            train_shares(model, opt, group, rank, WORLD, data[:3])
            at3 = {k: v.detach().clone() for k, v in group.full_state(model).items()}
            written = group.save(model, opt, path, background=True)
            assert (written is None) == (rank >= 2), "the first group writes, the second does not"
            train_shares(model, opt, group, rank, WORLD, data[3:])
            if written is not None:
                written.result(timeout=120)
            return at3, {k: v.detach().clone() for k, v in group.full_state(model).items()}
        finally:
            group.close()

    at3, at6 = run_members(WORLD, "background-checkpoint", member)[0]
    assert largest_difference(at6, reference(initial, data, dtype)) <= 1e-12
    assert largest_difference(resumed(2, 1, initial, [], dtype, load=path), at3) == 0.0
