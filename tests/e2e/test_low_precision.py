"""Models in bf16 and fp16 train: the commit vote stays exact whatever the parameters' dtype.

The vote's sample count once rode in the last gradient bucket, in the parameters' dtype: 3 x 111
samples sum to 332 in bf16, and 3 x 701 = 2103 is not an fp16 number, so every step was voted
down and the job stalled without a word."""
from __future__ import annotations

import math
import time

import pytest

from core.schema import TERMINAL_STATES
from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import running


@pytest.mark.parametrize("dtype,per_worker", [pytest.param("bfloat16", 111, marks=pytest.mark.slow), ("float16", 701)])
def test_low_precision_model_trains(run_root, dtype, per_worker):
    cfg = config_from_dict({
        "name": f"low-precision-{dtype}", "seed": 1, "workers": {"count": 3, "cpus": 0.5},
        "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32, "dtype": dtype},
                     "batch_size": per_worker},
        "optimizer": {"lr": 0.5}, "comm": {"timeout_s": 5}, "stop": {"max_steps": 20}, "eval_every": 10})
    job = ElasticJob(cfg).start()
    try:
        result = job.wait(timeout=60)
    finally:
        status = job.status()
        if status.state not in TERMINAL_STATES:
            pids = [m.pid for m in status.members]
            job.stop()
            time.sleep(0.5)
            left = [p for p in pids if running(p)]
            assert not left, f"stop() returned with workers alive: {left}"
    history = job.history()
    print(f"{dtype}: {result.state} at step {result.step}, losses {[round(r['loss'], 3) for r in history[::5]]}, "
          f"accuracy {result.metrics.get('accuracy')}")
    assert result.state == "FINISHED" and result.step == 20
    assert [r["step"] for r in history] == list(range(1, 21))
    losses = [r["loss"] for r in history]
    assert all(math.isfinite(v) for v in losses) and sum(losses[-5:]) < sum(losses[:5]), "no learning"
