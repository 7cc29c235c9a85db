"""Elastic membership: scale up and down mid-run, lose workers, never restart the survivors,
never lose or repeat a committed step or a sample."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import child_env, committed_samples, loaded_torch, paced, wait_until

REPO = Path(__file__).resolve().parents[2]


def make_config(name: str, **over) -> dict:
    cfg = {"name": name, "seed": 11, "workers": {"count": 2, "max": 5, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 64}, "batch_size": 16},
           "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "stop": {"max_steps": 1_000_000},
           "eval_every": 0}
    for key, value in over.items():
        cfg[key] = value
    # every worker in the first membership, however slowly its process starts on a loaded machine: the
    # tests count reshapes and a late worker would join as one more (the default waits 30 s)
    cfg["workers"] = {"start_grace_s": 600, **cfg["workers"]}
    # a job that trains until the test stops it paces its steps (the cores are shared with the tests beside it)
    return paced(cfg) if cfg["stop"]["max_steps"] >= 100_000 else cfg


def reshapes(job: ElasticJob) -> list[dict]:
    return [e for e in job.events() if e["kind"] == "reshape"]


def state_sources(job: ElasticJob, reshape: dict) -> dict:
    """Whose state each joiner of `reshape` loaded: noted on the reshape's event, or, where a joiner's
    message reached the coordinator after another member's report of the epoch's first step had closed
    the event (the two come from different workers, in no set order), in an event of its own. (Under
    load the reshape's own `state_sources` was once empty here, both joiners' events coming after it.)"""
    epoch = reshape["detail"]["membership_epoch"]
    sources = dict(reshape["detail"]["state_sources"])
    for e in job.events():
        detail = e.get("detail") or {}
        if detail.get("state_source") and detail.get("membership_epoch") == epoch:
            sources[detail["slot"]] = detail["state_source"]
    return sources


def assert_steps_exactly_once(job: ElasticJob) -> list[dict]:
    history = job.history()
    assert [r["step"] for r in history] == list(range(1, len(history) + 1))
    return history


def through_a_kill_a_join_and_a_scale_down(cfg: dict, timeout: float) -> tuple[ElasticJob, int]:
    """Run `cfg` (its kill a fault) past the replacement's join, scale it down to 2 and wait for it to
    FINISH; returns the job and the first step committed after the scale-down."""
    job = ElasticJob(config_from_dict(cfg)).start()
    wait_until(lambda: len(reshapes(job)) >= 2, what="kill and replacement join")
    job.scale(2)
    wait_until(lambda: len(reshapes(job)) >= 3, what="scale-down")
    last_event_step = reshapes(job)[2]["detail"]["first_committed_step"]
    assert job.wait(timeout=timeout).state == "FINISHED"
    return job, last_event_step


def longest_gap_around(history: list[dict], step: int, around: int = 10) -> float:
    times = [r["time"] for r in history if step - around <= r["step"] <= step + around]
    return float(np.max(np.diff(times)))


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_scale_up_by_api_then_down_by_cli(run_root):
    """(The longest step around each reshape is printed: a figure of benchmarks/recovery.py.)"""
    job = ElasticJob(config_from_dict(make_config("scale"))).start()
    job.wait_for(step=31)
    before = {m.slot: (m.actor_id, m.pid) for m in job.status().members}
    job.scale(4)
    up = job.wait_for("reshape")
    address = ray.get_runtime_context().gcs_address
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(run_root))
    cli = subprocess.run([sys.executable, "-m", "orchestrator", "scale", "scale", "3", "--address", address],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    print(cli.stdout, cli.stderr)
    assert cli.returncode == 0 and "scaling to 3" in cli.stdout
    job.wait_for("reshape", since=up["index"] + 1)
    beyond = subprocess.run([sys.executable, "-m", "orchestrator", "scale", "scale", "9", "--address", address],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert beyond.returncode == 2 and "workers.max" in beyond.stderr and beyond.stderr.count("\n") == 1
    status = job.status()
    after = {m.slot: (m.actor_id, m.pid) for m in status.members}
    assert all(after[slot] == ids for slot, ids in before.items()), "original workers must keep actor id and pid"
    assert [m.slot for m in status.members if m.rank >= 0] == ["w0", "w1", "w2"] and status.world_size == 3
    job.stop()
    history = assert_steps_exactly_once(job)
    up, down = reshapes(job)[:2]
    assert up["detail"]["joiners"] == ["w2", "w3"] and down["detail"]["leavers"] == ["w3"]
    joined = state_sources(job, up)
    assert set(joined) == {"w2", "w3"} and all(v["source"] == "w0" for v in joined.values()), joined
    for event in (up, down):
        gap = longest_gap_around(history, event["detail"]["first_committed_step"])
        print(f"{event['reason'][:60]}: first committed step {event['detail']['first_committed_step']}, "
              f"decided->first step {event['detail']['duration_s']:.2f}s, longest step around it {gap:.3f}s")
    text = subprocess.run([sys.executable, "-m", "orchestrator", "status", "scale", "--address", address],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60).stdout
    assert "reshape:" in text and "scale request" in text


def test_sigkill_in_allreduce_the_survivors_go_on_at_once_and_a_replacement_joins(run_root):
    """Every collective may wait 120 s (`comm.timeout_s`) and the test waits 60 s for the re-form: only
    the abort on the death (not a timeout) releases the survivors in time. How fast is a figure of
    benchmarks/recovery.py (printed here)."""
    cfg = make_config("kill-elastic", workers={"count": 4, "cpus": 0.5}, comm={"timeout_s": 120},
                      faults={"kills": [{"slot": "w2", "step": 40, "at": "allreduce", "how": "sigkill"}]})
    job = ElasticJob(config_from_dict(cfg)).start()
    fault = job.wait_for("fault", timeout=120)
    death = job.wait_for("reshape", timeout=60, since=fault["index"])
    job.wait_for("reshape", timeout=120, since=death["index"] + 1)  # the replacement
    # three epochs formed, each on its rank 0's store: the coordinator serves none and never loads torch
    assert not loaded_torch(job.status().coordinator_pid), "the coordinator loaded torch"
    job.stop()
    history = assert_steps_exactly_once(job)
    fired = next(e for e in job.events() if e["kind"] == "fault")["detail"]["fired_at"]
    first = next(r for r in history if r["time"] > fired)
    print(f"kill inside all-reduce at step 40 -> next committed step {first['step']} after "
          f"{first['time'] - fired:.3f}s at world size {first['world_size']}")
    assert first["world_size"] == 3 and first["step"] == 41
    death, replacement = reshapes(job)[:2]
    # Ray's notice of the death or the survivors' failed collective, whichever reaches the coordinator first
    assert death["detail"]["detector"] in ("actor death", "collective failure")
    assert death["detail"]["new_members"] == ["w0", "w1", "w3"]
    assert replacement["detail"]["joiners"] == ["w2"]  # the replacement takes the slot back


# The default tier's exactly-once test, for every kind of data and with a scale-up, a coordinator restart and
# a --resume besides: tests/e2e/test_data_sources.py (a TensorDataset among them, rank 0 killed).
@pytest.mark.parametrize("victim", [pytest.param("w1", marks=pytest.mark.slow),
                                    pytest.param("w0", marks=pytest.mark.slow)])  # rank 0 is the harder case
def test_exactly_once_data_over_a_kill_a_join_and_a_scale_down(run_root, victim):
    """`w0` is rank 0: the state source at the next epoch start and the member that reports history."""
    cfg = make_config(f"exactly-once-{victim}", workers={"count": 3, "max": 4, "cpus": 0.5},
                      workload={"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 2},
                      faults={"kills": [{"slot": victim, "step": 5, "at": "allreduce"}], "record_samples": True,
                              "stragglers": [{"slot": "w2", "delay_s": 0.08}]},  # data epoch 0 lasts ~19 s
                      stop={"max_steps": 300})
    job, last_event_step = through_a_kill_a_join_and_a_scale_down(cfg, timeout=120)
    n, global_batch = 1437, 6
    epoch_steps = n // global_batch  # steps 1..239 hold positions 0..1433 of data epoch 0
    assert last_event_step < epoch_steps, "the kill, join and scale-down must all fall inside one data epoch"
    per_step = committed_samples(job.run_dir, job.history())
    assert sorted(per_step) == list(range(1, 301))
    assert all(len(ids) == global_batch for ids in per_step.values()), "a step lost or repeated a sample"
    assert all(len(set(ids)) == global_batch for ids in per_step.values()), "two ranks trained on one sample"
    epoch = [i for s in range(1, epoch_steps + 1) for i in per_step[s]]
    missing = set(range(n)) - set(epoch)  # the 3 ids of epoch 0 that fall in the straddling step 240
    print(f"data epoch 0: {len(epoch)} ids in steps 1..{epoch_steps}, {len(set(epoch))} distinct, the last "
          f"{len(missing)} in step {epoch_steps + 1}; kill, join and scale-down by step {last_event_step}")
    assert len(set(epoch)) == len(epoch) == epoch_steps * global_batch
    assert len(missing) == n - len(epoch) and missing <= set(per_step[epoch_steps + 1])


def params(job: ElasticJob) -> list[torch.Tensor]:
    return list(torch.load(io.BytesIO((job.run_dir / "model.pt").read_bytes()), weights_only=True)["model"].values())


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_nothing_lost_two_kills_and_a_join_match_fault_free(run_root):
    """keep_global with `micro_batch` = the per-worker batch: at world size 2 each survivor's share
    (24) runs as 2 accumulated micro-steps, and the run still matches the fault-free one."""
    base = dict(workers={"count": 3, "max": 4, "cpus": 0.5}, stop={"max_steps": 300},
                workload={"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 64},
                          "batch_size": 16, "micro_batch": 16},
                faults={"stragglers": [{"slot": "w0", "delay_s": 0.05}]})  # a replacement joins by step ~270
    churn_cfg = make_config("churn", **base)
    churn_cfg["faults"] = dict(base["faults"], kills=[{"slot": "w1", "step": 30, "at": "allreduce"},
                                                       {"slot": "w2", "step": 200, "at": "step"}])
    churn = ElasticJob(config_from_dict(churn_cfg)).start()
    # the fault-free reference trains meanwhile, without the straggler (a sleep: it changes no number)
    clean = ElasticJob(config_from_dict(make_config("clean", **dict(base, faults={})))).start()
    assert clean.wait(timeout=180).state == "FINISHED"
    assert churn.wait(timeout=180).state == "FINISHED"
    events = reshapes(churn)
    joins = [e for e in events if e["detail"]["joiners"]]
    deaths = [e for e in events if e["detail"]["detector"] == "actor death"]
    assert len(deaths) == 2 and len(joins) >= 1
    history = assert_steps_exactly_once(churn)
    assert {(r["world_size"], r["micro_steps"]) for r in history} >= {(3, 1), (2, 2)}
    diff = max(float((a - b).abs().max()) for a, b in zip(params(churn), params(clean)))
    print(f"2 kills + {len(joins)} join(s) vs fault-free, keep_global batch, micro-steps at world size 2: "
          f"max abs diff {diff:.2e}")
    assert diff < 3e-6  # docs/elastic.md states 3.0e-7 (float summation order differs at world size 2)


SPLIT_BASE = dict(workers={"count": 3, "cpus": 0.5}, stop={"max_steps": 80}, comm={"timeout_s": 3})
"""The split-vote tests' job; the fault-free run of it is their common reference."""
FULL_WIDTH = dict(SPLIT_BASE, workers={"count": 3, "min": 3, "cpus": 0.5})
"""The same, at full width from step 1 (`min` = `count`): for the runs compared bit for bit (a late worker
would make step 1 sum at a smaller world size; see test_storage.py)."""


@pytest.fixture(scope="module")
def split_reference(ray_session):
    """The fault-free run of `FULL_WIDTH`, started when the first test that asks for it begins (it trains
    while that test's faulted run does) and trained once per process: the model's parameters, waited for."""
    job = ElasticJob(config_from_dict(make_config("split-clean", **FULL_WIDTH))).start()
    model: list = []

    def finished() -> list[torch.Tensor]:
        if not model:
            assert job.wait(timeout=120).state == "FINISHED"
            model.extend(params(job))
        return model
    return finished


def test_split_commit_vote_is_settled_at_the_next_epoch(run_root, split_reference):
    """Rank 0 loses the result of step 31's vote while the others commit it: the group re-forms at
    once, the members agree on step 31 (rank 0 receives it from w1), history takes step 31 from
    the agreement, and the run ends identical to a fault-free one."""
    split = ElasticJob(config_from_dict(make_config("split", **FULL_WIDTH, faults={"kills": [
        {"slot": "w0", "step": 30, "at": "vote"}]}))).start()
    assert split.wait(timeout=120).state == "FINISHED"
    history = assert_steps_exactly_once(split)
    assert len(history) == 80
    reform = next(e for e in reshapes(split) if e["detail"]["detector"] == "collective failure")
    assert reform["detail"]["new_members"] == ["w0", "w1", "w2"]
    assert state_sources(split, reform) == {"w0": {"source": "w1", "step": 31}}
    assert history[30]["membership_epoch"] < reform["detail"]["membership_epoch"] == history[31]["membership_epoch"]
    diff = max(float((a - b).abs().max()) for a, b in zip(params(split), split_reference()))
    print(f"split vote at step 31: re-formed in {reform['detail']['duration_s']:.2f}s, w0 took step 31 from w1; "
          f"max abs diff vs fault-free {diff:.1e}")
    assert diff == 0.0


def test_rank0_death_right_after_a_split_vote(run_root, split_reference):
    """w1 loses the result of step 31's vote that w0 (rank 0) and w2 commit; w0 then dies before
    its next step, with step 31 possibly unreported. The survivors agree on 31 (w1 takes it from
    w2), history gets step 31 from the new rank 0's catch-up, and the run matches a fault-free one."""
    churn = ElasticJob(config_from_dict(make_config("split0", **SPLIT_BASE, faults={"kills": [
        {"slot": "w1", "step": 30, "at": "vote"}, {"slot": "w0", "step": 31, "at": "step"}]}))).start()
    assert churn.wait(timeout=120).state == "FINISHED"
    history = assert_steps_exactly_once(churn)
    assert len(history) == 80
    death = next(e for e in reshapes(churn) if "w0" in e["detail"]["old_members"] and "w0" not in e["detail"]["new_members"])
    diff = max(float((a - b).abs().max()) for a, b in zip(params(churn), split_reference()))
    print(f"split vote at 31 then rank 0 died: re-formed as {death['detail']['new_members']} from "
          f"{death['detail']['state_sources']}; max abs diff vs fault-free {diff:.1e}")
    assert death["detail"]["state_sources"] == {"w1": {"source": "w2", "step": 31}}
    assert diff < 3e-6


@pytest.mark.slow  # the default tier's: tests/e2e/test_data_sources.py, token_shards (the same changes and more)
def test_exactly_once_on_token_shards_with_background_loading_over_a_kill_a_join_and_a_scale_down(run_root, tmp_path):
    """The language model on token shards (orchestrator/data/shards.py), its batches built ahead by the
    loader (two threads, two batches): every window of data epoch 0 is trained exactly once through a
    SIGKILL inside an all-reduce, the replacement's join and a scale-down. The loader may hold batches
    built for a split that no longer exists; none of them may be trained."""
    shards = tmp_path / "shards"
    shards.mkdir()
    rng = np.random.default_rng(5)
    for i, size in enumerate((4001, 3001, 3001)):  # 250 + 187 + 187 = 624 windows of 16 tokens
        np.save(shards / f"part-{i}.npy", rng.integers(0, 500, size=size).astype(np.uint16))
    cfg = make_config("exactly-once-shards", workers={"count": 3, "max": 4, "cpus": 0.5},
                      workload={"factory": "orchestrator.workloads.lm:gpt", "batch_size": 2,
                                "params": {"size": "tiny", "d_model": 16, "n_layer": 1, "n_head": 2, "seq_len": 16,
                                           "shards": str(shards), "vocab": 500},
                                "loader": {"workers": 2, "prefetch": 2}},
                      optimizer={"name": "adamw", "lr": 0.003},
                      faults={"kills": [{"slot": "w0", "step": 5, "at": "allreduce"}], "record_samples": True,
                              "stragglers": [{"slot": "w2", "delay_s": 0.08}]},
                      stop={"max_steps": 160})
    job, last_event_step = through_a_kill_a_join_and_a_scale_down(cfg, timeout=180)
    n, global_batch = 624, 6
    epoch_steps = n // global_batch  # steps 1..104 hold all 624 windows of data epoch 0
    assert last_event_step < epoch_steps, "the kill, join and scale-down must all fall inside one data epoch"
    per_step = committed_samples(job.run_dir, job.history())
    assert sorted(per_step) == list(range(1, 161))
    assert all(len(ids) == global_batch == len(set(ids)) for ids in per_step.values()), "a step lost or repeated a sample"
    epoch = [i for s in range(1, epoch_steps + 1) for i in per_step[s]]
    print(f"token shards with the loader: data epoch 0 in steps 1..{epoch_steps}: {len(epoch)} ids, "
          f"{len(set(epoch))} distinct; kill, join and scale-down by step {last_event_step}")
    assert len(set(epoch)) == len(epoch) == epoch_steps * global_batch == n
