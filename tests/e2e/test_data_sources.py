"""Exactly once for every kind of training data (actors/training/sources.py, docs/data.md): a job whose data is a
TensorDataset, a Hugging Face dataset, token shards, a Ray Data dataset of 120 blocks or a positioned
stream goes through a SIGKILL inside an all-reduce (rank 0), the replacement's join, a scale-up, a
scale-down and a SIGKILL of the coordinator, each after the one before has taken effect, and is then
resumed (`--resume`) from a checkpoint taken after the coordinator's restart. The sample ledgers
(`faults.record_samples`) of the first run up to the checkpoint and of the resumed run after it hold
each id of every data epoch once (600 samples an epoch: each change lands in whichever epoch it lands
in, however slowly the machine starts processes, and every epoch is checked).

The mechanism switched off: `positioned: false` makes the stream ignore the state it is given (a stream
that cannot be positioned), and its test fails (a joiner starts the stream over)."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import committed_samples, wait_until

GLOBAL_BATCH = 6
EVERY = 10
"""Checkpoint every EVERY steps."""
N = 600
"""Samples in a data epoch: 100 steps."""


def workload(source: str, tmp_path) -> tuple[dict, int]:
    """The workload section for `source`, and the samples in its data epoch."""
    if source == "token_shards":
        shards = tmp_path / "shards"
        shards.mkdir()
        rng = np.random.default_rng(5)
        for i, size in enumerate((4001, 3201, 2401)):  # 250 + 200 + 150 = 600 windows of 16 tokens
            np.save(shards / f"part-{i}.npy", rng.integers(0, 500, size=size).astype(np.uint16))
        return {"factory": "orchestrator.workloads.lm:gpt", "batch_size": 2,
                "params": {"size": "tiny", "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16,
                           "shards": str(shards), "vocab": 500}}, N
    params = {"source": source, "hidden": 16, "limit": N}
    return {"factory": "orchestrator.workloads.digits_sources:mlp", "batch_size": 2, "params": params}, N


def config(name: str, work: dict, steps: int, faults: dict) -> dict:
    cfg = {"name": name, "seed": 11, "workers": {"count": 3, "max": 4, "cpus": 0.5, "spares": 2, "start_grace_s": 600},
           "workload": {**work, "loader": {"workers": 2, "prefetch": 2}},
           "optimizer": {"name": "adamw", "lr": 0.003}, "stop": {"max_steps": steps}, "eval_every": 0,
           "checkpoint": {"every_steps": EVERY, "keep": 50},
           "faults": {"record_samples": True, **faults}}
    return cfg


def through_every_membership_change(cfg: dict) -> tuple[ElasticJob, int, int]:
    """Run `cfg` (its kill of rank 0 a fault; it trains until stopped) past the replacement's join, a
    scale-up to 4, a scale-down to 2 and a SIGKILL of the coordinator, each after the one before has
    taken effect; then past the first checkpoint after the restart, C, and stop it. Returns the job,
    C, and F: the last step of the data epoch that C's next step falls in."""
    job = ElasticJob(config_from_dict(cfg)).start()
    reshapes = lambda: [e for e in job.events() if e["kind"] == "reshape"]  # noqa: E731
    wait_until(lambda: len(reshapes()) >= 2, what="the kill and the replacement's join")
    for count, seen in ((4, 3), (2, 4)):
        job.scale(count)
        wait_until(lambda: len(reshapes()) >= seen, what=f"the scale to {count}")
    os.kill(job.status().coordinator_pid, signal.SIGKILL)
    restarted = wait_until(lambda: (s := job.status()).incarnation == 1 and s.state == "RUNNING" and s,
                           what="the restarted coordinator")
    resume_at = (restarted.step // EVERY + 1) * EVERY
    job.wait_for(step=resume_at + 1)
    job.stop()
    steps_per_epoch = N // GLOBAL_BATCH
    return job, resume_at, (resume_at // steps_per_epoch + 1) * steps_per_epoch


# The default tier runs Ray Data (its holder and blocks are Ray's; a `MapSource` like the TensorDataset, so
# it carries the cursor every map-style source shares through Ray). The others run with --run-slow: the
# TensorDataset, Hugging Face and token-shard cases read through that same cursor (in process:
# tests/unit/test_sampler.py, test_sources.py, test_token_shards.py), and
# a stream's state reaches a joiner and a resume through the same state bytes, in process in
# tests/unit/test_sources.py::test_a_joiner_and_a_resume_continue_a_stream_where_the_committed_state_left_it.
@pytest.mark.parametrize("source", [pytest.param("tensors", marks=pytest.mark.slow),
                                    pytest.param("datasets", marks=pytest.mark.slow),
                                    pytest.param("token_shards", marks=pytest.mark.slow), "ray_data",
                                    pytest.param("stream", marks=pytest.mark.slow)])
def test_each_sample_once_through_kill_join_scale_up_down_coordinator_restart_and_resume(run_root, tmp_path, source):
    if source == "datasets":
        pytest.importorskip("datasets")
    work, n = workload(source, tmp_path)
    faults = {"kills": [{"slot": "w0", "step": 10, "at": "allreduce"}],
              "stragglers": [{"slot": "w1", "delay_s": 0.05}]}
    job, resume_at, final = through_every_membership_change(config(f"sources-{source}", work, 10 ** 6, faults))
    first = [r for r in job.history() if r["step"] <= resume_at]
    changes = [e["detail"].get("first_committed_step") for e in job.events() if e["kind"] == "reshape"]
    checkpoint = next((job.run_dir / "checkpoints").glob(f"step-{resume_at:08d}-*.pt"))

    again = config(f"sources-{source}", work, final, {})
    again["workers"]["spares"] = 0
    resumed = ElasticJob(config_from_dict(again), resume_from=str(checkpoint)).start()
    assert resumed.wait(timeout=240).state == "FINISHED"
    second = resumed.history()
    assert [r["step"] for r in second] == list(range(resume_at + 1, final + 1))

    per_step = committed_samples(job.run_dir, first)  # the first run's steps up to the checkpoint
    per_step.update(committed_samples(resumed.run_dir, second))
    assert sorted(per_step) == list(range(1, final + 1))
    assert all(len(ids) == GLOBAL_BATCH == len(set(ids)) for ids in per_step.values()), "a step lost or repeated a sample"
    steps_per_epoch = n // GLOBAL_BATCH
    epochs = final // steps_per_epoch
    for e in range(epochs):
        ids = [i for s in range(e * steps_per_epoch + 1, (e + 1) * steps_per_epoch + 1) for i in per_step[s]]
        assert sorted(ids) == list(range(n)), f"data epoch {e}: {len(ids)} ids, {len(set(ids))} distinct"
    print(f"{source}: changes committed at steps {changes}, resumed from step {resume_at} to {final}: each of the "
          f"{n} ids once in each of data epochs 0..{epochs - 1}")


def test_a_stream_that_cannot_be_positioned_fails_the_job_before_any_step_in_one_line(run_root, tmp_path):
    work = {"factory": "orchestrator.workloads.digits_sources:mlp", "batch_size": 2,
            "params": {"source": "plain_stream", "hidden": 16}}
    cfg = config("sources-plain-stream", work, 50, {})
    cfg["workers"]["count"] = 1
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=120)
    failure = next(e for e in job.events() if e["kind"] == "failure")
    print(f"{result.state}: {failure['reason']}")
    assert result.state == "FAILED" and not job.history()
    assert "train_data is an iterable (PlainStream) without state_dict()/load_state_dict()" in failure["reason"]
    retried = [e for e in job.events() if e["kind"] == "failure" and e["detail"].get("detector") == "start"]
    retired = [e for e in job.events() if e["kind"] == "retired"]
    assert not retried and len(retired) == 1, "a refusal is the same at every start: never tried again"
