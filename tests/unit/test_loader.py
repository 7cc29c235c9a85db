"""Background loading (actors/training/loader.py, `workload.loader`): replicas in threads of this process
(testkit's LocalJob). The reference is the replica with the loader off: the loader may change when a
batch is built, never which samples a step trains or what it computes."""
from __future__ import annotations

import threading

import numpy as np
import torch

from actors.training.loader import BatchLoader
from testkit.harness import LocalJob


def config(loader: dict | None = None, steps: int = 24) -> dict:
    return {"name": "loading", "seed": 3, "workers": {"count": 2, "cpus": 1},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 8,
                         **({"loader": loader} if loader else {})},
            "optimizer": {"lr": 0.05}, "stop": {"max_steps": steps}, "eval_every": 0,
            "faults": {"record_samples": True}}


def ledger(run_dir) -> dict[str, list[str]]:
    return {slot: (run_dir / "samples" / f"{slot}.txt").read_text().splitlines() for slot in ("w0", "w1")}


def test_with_the_loader_each_step_trains_what_it_would_have_trained_on_the_step(tmp_path):
    runs = {}
    for name, loader in (("inline", None), ("loader", {"workers": 2, "prefetch": 3})):
        job = LocalJob(config(loader), ["w0", "w1"], str(tmp_path / name))
        job.run(("w0", "w1"), 16)
        runs[name] = (ledger(tmp_path / name), job.parameters("w0"), job.replicas["w0"].feed._loader)
    assert runs["loader"][0] == runs["inline"][0], "another sample order or split"
    assert all(torch.equal(a, b) for a, b in zip(runs["loader"][1], runs["inline"][1]))
    loader = runs["loader"][2]
    assert loader is not None and loader.taken >= 20 and loader.missed <= 2, (loader.taken, loader.missed)


def test_a_new_split_or_a_cursor_moved_back_never_takes_a_batch_built_for_the_old_one(tmp_path):
    """The shares built ahead for two members are dropped when one member is left (a reshape); a step
    that did not commit (the cursor back) gets its own share again, not the next one."""
    from actors.plan import Plan

    job = LocalJob(config({"workers": 1, "prefetch": 2}), ["w0", "w1"], str(tmp_path))
    replica = job.replicas["w0"]
    two = Plan(version=1, membership_epoch=1, members=("w0", "w1"), group_name="g1", store_host="", store_port=0,
               timeout_s=1.0, global_batch=16)
    one = Plan(version=2, membership_epoch=2, members=("w0",), group_name="g2", store_host="", store_port=0,
               timeout_s=1.0, global_batch=16)

    feed = replica.feed

    def inline(plan, cursor):
        return feed.share(plan, cursor)[0]  # what the step reads without a loader

    assert np.array_equal(feed.micro_batches(two, 0, None)[0], inline(two, 0))
    assert len(feed._loader.pending()) == 2
    # step 1 committed (cursor 16); then the world shrinks before step 2
    assert np.array_equal(feed.micro_batches(one, 16, None)[0], inline(one, 16)), "the old split's share was taken"
    assert all(key[2] == ("w0",) for key in feed._loader.pending()), "the old split's shares are still held"
    # that step did not commit: its share again
    assert np.array_equal(feed.micro_batches(one, 16, None)[0], inline(one, 16))
    feed.close()


def test_a_failing_sample_fails_the_step_that_trains_it_and_the_loader_holds_at_most_prefetch():
    built, gate = [], threading.Event()

    def build(n):
        def make():
            gate.wait(10)
            built.append(n)
            if n == 3:
                raise ValueError("sample 3 is corrupt")
            return n
        return make
    loader = BatchLoader(workers=2, prefetch=2)
    loader.ahead([(n, build(n)) for n in range(1, 6)])
    assert loader.pending() == [1, 2], "more than prefetch batches held"
    gate.set()
    assert loader.take(1) == 1 and loader.take(2) == 2
    loader.ahead([(3, build(3)), (4, build(4))])
    try:
        loader.take(3)
    except ValueError as err:
        assert "sample 3 is corrupt" in str(err)
    else:
        raise AssertionError("the sample's error did not reach the step")
    loader.close()


def test_loader_processes_train_what_the_step_would_and_read_every_batch_ahead(tmp_path):
    """`workload.loader.processes`: the reads run in spawned processes that built the workload
    themselves; the samples, their order and the parameters are those of the run without a loader."""
    runs = {}
    for name, loader in (("inline", None), ("processes", {"workers": 2, "prefetch": 2, "processes": True})):
        job = LocalJob(config(loader), ["w0", "w1"], str(tmp_path / name))
        job.run(("w0", "w1"), 16)
        runs[name] = (ledger(tmp_path / name), job.parameters("w0"), job.replicas["w0"])
    assert runs["processes"][0] == runs["inline"][0], "another sample order or split"
    assert all(torch.equal(a, b) for a, b in zip(runs["processes"][1], runs["inline"][1]))
    replica = runs["processes"][2]
    assert replica.feed._fetcher is not None and replica.feed._loader.taken >= 20


def test_loader_processes_refuse_a_stream(tmp_path):
    import pytest

    from core.schema import WorkloadRefused

    cfg = config({"workers": 1, "processes": True})
    cfg["workload"] = {**cfg["workload"], "factory": "orchestrator.workloads.digits_sources:mlp",
                       "params": {"source": "stream"}}
    with pytest.raises(WorkloadRefused, match="loader.processes reads map-style"):
        LocalJob(cfg, ["w0"], str(tmp_path))
