"""Replica groups in the replica's own step loop (`sharding.group_size` > 1): real replicas in threads over
in-process gloo (testkit's `LocalJob`), no Ray, against a single-process AdamW written here on the same global
batches (the sampler's order and the plain mean loss, as tests/unit/test_policy_oracles.py writes them).

A member that leaves mid-run (published out of the plan, which aborts the epoch under way, as the
coordinator does at a death) takes no part in the next epoch: the survivors re-cut the replica from what
they hold. BSP's global batch does not change with the membership, so every run here must equal the one
reference, whatever the groups and whoever leaves or joins."""
from __future__ import annotations

import copy

import pytest
import torch

from actors.training.sharded_replica import ReplicaShards
from actors.training.training_state import read_state
from testkit.harness import LocalJob
from tests.unit.test_policy_oracles import config, reference_bsp

ADAMW = {"name": "adamw", "lr": 0.01}
STEPS, BATCH = 12, 40
SLOTS = ("w0", "w1", "w2", "w3")


def sharded_job(tmp_path, group_size: int, mirror: bool = True, eval_every: int = 0, spare: bool = False) -> LocalJob:
    cfg = {**config({"policy": "bsp"}, ADAMW, STEPS, 4), "sharding": {"group_size": group_size, "mirror": mirror},
           "eval_every": eval_every}
    return LocalJob(cfg, [*SLOTS, "w4"] if spare else list(SLOTS), str(tmp_path))


def final_model(job: LocalJob) -> list[torch.Tensor]:
    """The final model, as rank 0 hands it to the coordinator (gathered whole by the first group)."""
    return list(read_state(job.replicas["w0"].final_state())["model"].values())


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def on_step(job: LocalJob, actions: dict[int, object]) -> None:
    """Run `actions[step]` (once) when w0 begins training `step` + 1: the membership changes land at a named step."""
    fire = job.replicas["w0"].faults.maybe_fire
    done: set[int] = set()

    def hook(kind: str, step: int) -> None:
        if kind == "step" and step in actions and step not in done:
            done.add(step)
            actions[step]()  # type: ignore[operator]
        fire(kind, step)

    job.replicas["w0"].faults.maybe_fire = hook  # type: ignore[method-assign]


@pytest.mark.parametrize("group_size", [2, 4])
def test_bsp_over_replica_groups_equals_one_process_on_the_global_batches(tmp_path, group_size):
    job = sharded_job(tmp_path, group_size)
    job.run(SLOTS, BATCH)
    diff = max_diff(final_model(job), reference_bsp(ADAMW, BATCH, STEPS))
    print(f"group_size {group_size}: {diff:.2e} from one process")
    assert diff <= 1e-5
    assert [r["step"] for r in job.link.records] == list(range(1, STEPS + 1))


def test_without_the_sum_across_groups_the_replicas_drift_from_one_process(tmp_path, monkeypatch):
    """The mechanism switched off: each group steps on its own half of the global batch."""
    monkeypatch.setattr(ReplicaShards, "reduce", lambda self, model, tail: self._current().group.comm.all_reduce(
        tail).wait() or tail)
    job = sharded_job(tmp_path, 2)
    job.run(SLOTS, BATCH)
    assert max_diff(final_model(job), reference_bsp(ADAMW, BATCH, STEPS)) > 1e-3


def test_a_member_leaves_and_a_joiner_takes_its_place_from_the_live_members_memory(tmp_path):
    """Groups of 2: w3 leaves after step 5 (the survivors go on as one group of 3, w3's shard taken from the
    copies and the other group), then w4 joins after step 8 (two groups of 2 again; it receives its shard and
    w0's position). Every step is committed once, by the members of its plan; the evaluations (every 4 steps,
    by the first group together) and the final model are the reference's."""
    job = sharded_job(tmp_path, 2, eval_every=4, spare=True)
    on_step(job, {
        5: lambda: job.publish(("w0", "w1", "w2"), 2, BATCH, aborts_epoch=1, reason="w3 left (the test)"),
        8: lambda: (job.publish(("w0", "w1", "w2", "w4"), 3, BATCH), job.start(["w4"])),
    })
    job.publish(SLOTS, 1, BATCH)
    job.start(list(SLOTS))
    outcomes = job.wait(120)
    assert all(o.ok for o in outcomes.values()), outcomes
    diff = max_diff(final_model(job), reference_bsp(ADAMW, BATCH, STEPS))
    print(f"leave at 5, join at 8: {diff:.2e} from one process")
    assert diff <= 1e-5
    records = job.link.records
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["world_size"] for r in records] == [4] * 5 + [3] * 4 + [4] * 3
    assert [r["step"] for r in records if "metrics" in r] == [4, 8, 12]
    assert job.link.finals and "accuracy" in job.link.finals[-1]["metrics"]
    assert ("state_received", ("w4", 3, "w0", 9)) in job.link.calls, "the joiner took w0's position at step 9"


@pytest.mark.parametrize("mirror", [True, False])
def test_one_group_of_four_survives_a_departure_only_from_the_copies(tmp_path, mirror):
    """One group of 4: the shard of the member that leaves is held by no other group, only by its
    neighbour's copy. Without the copies the survivors cannot go on, and say why."""
    job = sharded_job(tmp_path, 4, mirror=mirror)
    on_step(job, {5: lambda: job.publish(("w0", "w1", "w2"), 2, BATCH, aborts_epoch=1, reason="w3 left (the test)")})
    job.publish(SLOTS, 1, BATCH)
    job.start(list(SLOTS))
    outcomes = job.wait(120)
    if not mirror:
        failed = {s: o.error for s, o in outcomes.items() if s != "w3"}
        assert all(not outcomes[s].ok and "no committed state is held whole" in e for s, e in failed.items()), failed
        return
    assert all(o.ok for o in outcomes.values()), outcomes
    assert max_diff(final_model(job), reference_bsp(ADAMW, BATCH, STEPS)) <= 1e-5
    assert [r["step"] for r in job.link.records] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("section, value", [
    ("sync", {"policy": "local_sgd", "h": 4}),
    ("compression", {"codec": "fp16"}),
    ("optimizer", {"name": "sgd", "lr": 0.1}),
    ("optimizer", {**ADAMW, "clip_grad_norm": 1.0}),
    ("training", {"precision": "bf16-mixed"}),
    ("training", {"compile": True}),
])
def test_what_replica_groups_do_not_run_yet_is_refused_in_one_line(section, value):
    from core.schema import ConfigError, JobConfig, parse

    cfg = {**config({"policy": "bsp"}, ADAMW, STEPS, 4), "sharding": {"group_size": 2}, section: value}
    with pytest.raises(ConfigError) as caught:
        parse(JobConfig, cfg)
    message = str(caught.value)
    assert message.startswith(section) and "sharding.group_size 2" in message and "\n" not in message, message


class KeepingLink:
    """The recording link, keeping each checkpoint's bytes (`LocalLink` keeps only its step)."""

    def __init__(self, link) -> None:
        self._link = link
        self.checkpoints: dict[int, bytes] = {}

    def save_checkpoint(self, step: int, blob: bytes) -> None:
        self.checkpoints[step] = blob
        self._link.save_checkpoint(step, blob)

    def __getattr__(self, name: str):
        return getattr(self._link, name)


@pytest.mark.parametrize("slots, group_size", [(("w0", "w1", "w2"), 1), (SLOTS, 4)])
def test_a_checkpoint_of_groups_of_two_resumes_at_another_world_and_group_size_equal_to_going_on(
        tmp_path, slots, group_size):
    """Written at step 8 by 4 workers in groups of 2 (the first group gathers the replica whole: its model and
    AdamW's state, as an unsharded run writes them), resumed by `slots` in groups of `group_size`: the run to
    step 12 equals one process straight through."""
    kept: list[KeepingLink] = []
    cfg = {**config({"policy": "bsp"}, ADAMW, STEPS, 4), "sharding": {"group_size": 2},
           "checkpoint": {"every_steps": 4}}
    job = LocalJob(cfg, list(SLOTS), str(tmp_path / "first"), wrap_link=lambda link: kept.append(KeepingLink(link)) or kept[0])
    job.run(SLOTS, BATCH)
    assert sorted(kept[0].checkpoints) == [4, 8, 12]
    resumed_cfg = {**config({"policy": "bsp"}, ADAMW, STEPS, len(slots)), "sharding": {"group_size": group_size}}
    resumed = LocalJob(resumed_cfg, list(slots), str(tmp_path / "resumed"))
    assert resumed.replicas["w0"].load_checkpoint(kept[0].checkpoints[8]) == 8
    resumed.run(slots, BATCH)
    if group_size == 1:
        model = resumed.agreed_parameters(list(slots))
    else:
        model = final_model(resumed)
    diff = max_diff(model, reference_bsp(ADAMW, BATCH, STEPS))
    print(f"resumed at step 8 by {len(slots)} in groups of {group_size}: {diff:.2e} from one process")
    assert diff <= 1e-5
    assert [r["step"] for r in resumed.link.records] == list(range(9, STEPS + 1))


def test_the_structure_each_epoch_builds_its_shards_on_keeps_tied_parameters_tied():
    """The built-in GPT ties its head to its embedding: the structure kept to build each epoch's sharded model
    must hold one parameter for both, as the model does (else the shards' parameters do not line up)."""
    from actors.training.sharded_replica import meta_copy
    from orchestrator.workloads.lm import gpt

    model = gpt(size="tiny").model
    copied = meta_copy(model)
    assert [n for n, _ in copied.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p.is_meta for p in copied.parameters()) and not any(p.is_meta for p in model.parameters())
    untied = copy.deepcopy(model).to("meta")
    assert len(list(untied.parameters())) == len(list(model.parameters())) + 1, "the mechanism's reason is gone"
