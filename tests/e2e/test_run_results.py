"""A run's results end to end (the CLI, real workers through Ray, BSP on torch's reducer over gloo): the
workload's step metrics reach the progress line and history as the mean over each global batch, the
summary says where the final model and the last checkpoint are, and `load_model` rebuilds the final
model from the run folder. (In process, with uneven shares: tests/unit/test_results.py.)"""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
import yaml

from orchestrator import load_model
from testkit.harness import child_env, committed_samples

REPO = Path(__file__).resolve().parents[2]
WORKDIR = REPO / "tests" / "workloads"


def test_a_finished_run_shows_its_step_metrics_and_where_its_model_and_checkpoint_are(tmp_path, ray_session):
    config = tmp_path / "metrics.yaml"
    config.write_text(yaml.safe_dump({
        "name": "results-e2e", "seed": 5, "workers": {"count": 2, "cpus": 0.5},
        "workload": {"factory": "custom_workload:make", "params": {"n": 600, "metrics": "tuple"}, "batch_size": 8},
        "optimizer": {"name": "sgd", "lr": 0.2}, "stop": {"max_steps": 30}, "eval_every": 0, "progress_every_s": 0,
        "checkpoint": {"every_steps": 10}, "faults": {"record_samples": True}}))
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(tmp_path / "runs"))
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(config), "--address", address], cwd=WORKDIR,
                          env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout[-2500:], proc.stderr[-1500:])
    assert proc.returncode == 0
    run_dir = Path(re.search(r"run dir: (\S+)", proc.stdout).group(1))
    # a progress line with a step (the last one, [finished], where the 30 steps took less than a poll)
    assert re.search(r"\[(running|finished)\] step [1-9]\d*/30 loss [\d.]+ accuracy [\d.]+ mean_label [\d.]+ steps/s",
                     proc.stdout)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "FINISHED" and status["checkpoint"]["step"] == 30
    assert f"  final model: {run_dir / 'model.pt'} (orchestrator.load_model('{run_dir}') rebuilds it)" in proc.stdout
    assert f"  last checkpoint: {status['checkpoint']['path']} (step 30; --resume continues from it)" in proc.stdout
    assert Path(status["checkpoint"]["path"]).is_file()

    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    applied = committed_samples(run_dir, history)
    assert [r["step"] for r in history] == list(range(1, 31))
    for record in history:  # the label of sample i is i % 4: the global batch's mean label, from its ids
        ids = applied[record["step"]]
        assert record["step_metrics"]["mean_label"] == pytest.approx(sum(i % 4 for i in ids) / len(ids), abs=1e-6)
    assert status["step_metrics"] == history[-1]["step_metrics"]

    sys.path.insert(0, str(WORKDIR))  # the factory, importable here as for the job
    try:
        model = load_model(run_dir)
    finally:
        sys.path.remove(str(WORKDIR))
    final = torch.load(io.BytesIO((run_dir / "model.pt").read_bytes()), weights_only=True)["model"]
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in final.items())
