"""Compressed BSP end to end: a `bytegrad` run (uint8 scatter-gather) through a kill inside its
all-to-all and a split vote finishes with every step once in history."""
from __future__ import annotations

import pytest

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob

STEPS = 60


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_bytegrad_through_a_kill_and_a_split_vote_finishes(run_root):
    cfg = {"name": "bytegrad-churn", "seed": 4, "workers": {"count": 3, "max": 3, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 8},
           "optimizer": {"lr": 0.05, "momentum": 0.9}, "sync": {"policy": "bytegrad"},
           "compression": {"codec": "uint8", "feedback": True}, "stop": {"max_steps": STEPS}, "eval_every": 0,
           "comm": {"timeout_s": 3},
           "faults": {"kills": [{"slot": "w1", "step": 10, "at": "allreduce"},  # inside the all-to-all
                                {"slot": "w0", "step": 40, "at": "vote"}],      # rank 0 loses step 41's vote
                      "stragglers": [{"slot": "w2", "delay_s": 0.02}]}}
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=180)
    assert result.state == "FINISHED" and result.step == STEPS, result
    history = job.history()
    assert [r["step"] for r in history] == list(range(1, STEPS + 1)), "each step once"
    events = job.events()
    detectors = [e["detail"]["detector"] for e in events if e["kind"] == "reshape"]
    faults = {e["detail"]["phase"] for e in events if e["kind"] == "fault"}
    per_step = [r["bytes_sent"] for r in history]
    print(f"bytegrad: {result.state} at {result.step}; reshapes {detectors}; faults {sorted(faults)}; "
          f"bytes sent by rank 0 at the end {per_step[-1]}")
    assert faults == {"allreduce", "vote"}
    assert "actor death" in detectors and "collective failure" in detectors, detectors
