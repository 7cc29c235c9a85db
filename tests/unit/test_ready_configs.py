"""Every ready config in configs/ validates and trains: a few steps of each with two replicas in
process (no Ray), through the policy it names. The full runs are in tests/e2e (main job) and the
slow tier (tests/e2e/test_policy_accuracy.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import load_config
from testkit.harness import LocalJob

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


# lm_lab is lm_bsp's GPT with `auto` (as lab_digits) and a modelled compute of 0 ms: slow tier (docs/testing.md)
GPU_ONLY = pytest.mark.skip(reason="a GPU config (a GPU a worker, a prepared data_dir): its model is checked in "
                                   "tests/unit/test_hf.py::test_the_gpt2_small_config_builds_gpt2_small")


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=pytest.mark.slow if p.stem == "lm_lab" else
                                               GPU_ONLY if p.stem == "gpt2_small" else ()) for p in CONFIGS])
def test_ready_config_trains(path, tmp_path):
    config = load_config(path, ["workers.count=2", "workers.min=1", "stop.max_steps=20", "stop.target=null",
                                "eval_every=0"])
    if config.sync.policy == "auto":  # resolved as ElasticJob.start resolves it
        from orchestrator.planner import choose

        config = choose(config)[0]
        assert config.sync.policy != "auto" and config.policy_choice
    config = config.to_dict()
    job = LocalJob(config, ["w0", "w1"], str(tmp_path))
    job.run(("w0", "w1"), 2 * config["workload"]["batch_size"])
    steps = [r["step"] for r in job.link.records]
    assert steps and steps[-1] == 20, steps
