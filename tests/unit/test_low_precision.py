"""Models in bf16 and fp16 train: the commit vote stays exact whatever the parameters' dtype.

The vote's sample count once rode in the last gradient bucket, in the parameters' dtype: 3 x 111
samples sum to 332 in bf16, and 3 x 701 = 2103 is not an fp16 number, so every step was voted
down and the job stalled without a word. Three real replicas in threads over in-process gloo (the
worker's step loop and its vote; no Ray): a vote that fails every step leaves no committed step."""
from __future__ import annotations

import math

import pytest

from orchestrator.config import config_from_dict
from testkit.harness import LocalJob


@pytest.mark.parametrize("dtype,per_worker", [("bfloat16", 111), ("float16", 701)])
def test_low_precision_model_trains(tmp_path, dtype, per_worker):
    config = config_from_dict({
        "name": f"low-precision-{dtype}", "seed": 1, "workers": {"count": 3, "cpus": 0.5},
        "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32, "dtype": dtype},
                     "batch_size": per_worker},
        "optimizer": {"lr": 0.5}, "comm": {"timeout_s": 30}, "stop": {"max_steps": 20}, "eval_every": 0}).to_dict()
    job = LocalJob(config, ["w0", "w1", "w2"], str(tmp_path))
    job.run(("w0", "w1", "w2"), 3 * per_worker)
    history = job.link.records  # rank 0 reports a synchronous job's history
    losses = [r["loss"] for r in history]
    print(f"{dtype}: losses {[round(v, 3) for v in losses[::5]]}")
    assert [r["step"] for r in history] == list(range(1, 21)), "every step committed once"
    assert all(math.isfinite(v) for v in losses) and sum(losses[-5:]) < sum(losses[:5]), "no learning"
