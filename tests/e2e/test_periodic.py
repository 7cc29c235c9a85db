"""Periodic policies under churn, end to end: a kill inside a round's all-reduce, a kill between
rounds, a join, a scale-down and then a split round that rank 0 loses, in one local-SGD run."""
from __future__ import annotations

from collections import defaultdict

import pytest

from algorithms.rules.sampler import GlobalSampler
from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import wait_until

H, STEPS, PER_WORKER = 4, 400, 2


def reshapes(job: ElasticJob) -> list[dict]:
    return [e for e in job.events() if e["kind"] == "reshape"]


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_local_sgd_under_churn_applies_every_sample_once_or_counts_it_dropped(run_root):
    cfg = {"name": "periodic-churn", "seed": 5,
           "workers": {"count": 4, "max": 5, "cpus": 0.5, "failure_budget": 1},  # a dead slot is retired: w4 replaces
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": PER_WORKER},
           "optimizer": {"lr": 0.05, "momentum": 0.9}, "sync": {"policy": "local_sgd", "h": H},
           "stop": {"max_steps": STEPS}, "eval_every": 0, "comm": {"timeout_s": 5},
           "faults": {"record_samples": True, "stragglers": [{"slot": "w2", "delay_s": 0.05}],
                      "kills": [{"slot": "w1", "step": 8, "at": "allreduce"},  # inside round 8's all-reduce
                                {"slot": "w3", "step": 18, "at": "step"},      # between rounds 16 and 20
                                # rank 0 loses round 300's result, once the join and the scale-down are
                                # over: a reshape in flight would supersede the failed epoch's report
                                {"slot": "w0", "step": 300, "at": "vote"}]}}
    job = ElasticJob(config_from_dict(cfg)).start()
    pids = wait_until(lambda: (p := {m.slot: m.pid for m in job.status().members if m.slot in ("w0", "w2")})
                      and all(p.values()) and p, what="the survivors' pids")
    wait_until(lambda: any(e["detail"]["joiners"] == ["w4"] for e in reshapes(job)), timeout=120, what="w4 to join")
    job.scale(2)
    wait_until(lambda: any(e["detail"]["leavers"] for e in reshapes(job)), timeout=120, what="the scale-down")
    result = job.wait(timeout=240)
    assert result.state == "FINISHED" and result.step == STEPS, result
    final = job.status()
    assert {m.slot: m.pid for m in final.members if m.slot in ("w0", "w2")} == pids, "survivors were restarted"

    history = job.history()
    rounds = [r["step"] for r in history]
    assert rounds == sorted(set(rounds)) and rounds[-1] == STEPS, "each round once, in order"
    assert all(r["prev"] == p for r, p in zip(history, [0] + rounds[:-1])), "rounds chain without a gap"
    detectors = [e["detail"]["detector"] for e in reshapes(job)]
    assert "actor death" in detectors and "collective failure" in detectors, detectors

    # Every step's global batch: applied by the members that committed its round, or counted dropped.
    committed_in = {}
    for record in history:
        for step in range(record["prev"] + 1, record["step"] + 1):
            committed_in[step] = record["membership_epoch"]
    applied, dropped = defaultdict(list), defaultdict(list)
    for path in (job.run_dir / "samples").glob("*.txt"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[0] == "dropped":
                dropped[int(words[2])] += map(int, words[3:])
                continue
            step, epoch, ids = int(words[0]), int(words[1]), list(map(int, words[2:]))
            if committed_in.get(step) == epoch:
                applied[step] += ids
    counted = sum(r.get("dropped_samples", 0) for r in history)
    sampler = GlobalSampler(1437, 5)
    lost_steps = sorted(s for s in dropped if dropped[s])
    for step in range(1, STEPS + 1):
        batch = sampler.global_batch((step - 1) * 4 * PER_WORKER, 4 * PER_WORKER).tolist()
        got = applied[step] + dropped[step]
        assert sorted(got) == sorted(batch), f"step {step}: applied {sorted(applied[step])} dropped {dropped[step]} " \
                                             f"vs the batch {sorted(batch)}"
    print(f"local_sgd h={H} under churn: {len(history)} rounds, reshapes {detectors}; dropped {counted} samples "
          f"in steps {lost_steps}; every other sample applied exactly once")
    assert counted == sum(len(v) for v in dropped.values()) > 0
