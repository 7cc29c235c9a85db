"""A job with one bad training sample, on Ray (docs/data.md, bad samples): the data review's repro (3
workers, `workers.min` 2, the sample read at step 5). With `on_bad_sample: fail` the CLI's job ends
FAILED within seconds of the step before it, the sample's id and error in one line, exit code 1, no
worker retired and no pause (before: six failures and replacements, w1 and w2 retired, then PAUSED for
minutes). With `skip` the job FINISHES and counts the sample skipped in status and history. Both in the slow
tier: the default tier's tests of their mechanism are in process (tests/unit/test_bad_data.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from algorithms.rules.sampler import GlobalSampler
from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import child_env, paced

REPO = Path(__file__).resolve().parents[2]
SEED, WORKERS, BATCH = 0, 3, 8
BAD = int(GlobalSampler(1437, SEED).global_batch(4 * WORKERS * BATCH + 5, 1)[0])
"""The digits sample at position 101 of data epoch 0: w0's share of step 5."""
FAILED_WITHIN_S = 30.0
"""From the last committed step to FAILED: the mechanism's bound (it took seconds here; minutes before)."""


def config(name: str, on_bad_sample: str, steps: int) -> dict:
    return paced({
        "name": name, "seed": SEED,
        "workload": {"factory": "orchestrator.workloads.digits_sources:mlp",
                     "params": {"source": "bad_samples", "hidden": 16, "bad": [BAD]},
                     "batch_size": BATCH, "on_bad_sample": on_bad_sample},
        "optimizer": {"lr": 0.05}, "stop": {"max_steps": steps}, "eval_every": 0,
        "workers": {"count": WORKERS, "min": 2, "cpus": 0.5},
    })


def run_files(root: Path, name: str, file: str) -> list[dict]:
    (path,) = root.glob(f"{name}/*/{file}")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_one_bad_sample_fails_the_job_in_one_line_within_seconds_from_the_cli(tmp_path, run_root):
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(yaml.safe_dump(config("bad-fail", "fail", 10_000)))
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(run_root))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(config_file), "--address",
                           ray.get_runtime_context().gcs_address], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    line = f"bad training sample {BAD}: ValueError: corrupt record {BAD}"
    assert proc.returncode == 1, proc.returncode
    assert f"; cause: {line}\n" in proc.stdout
    events = run_files(run_root, "bad-fail", "events.jsonl")
    history = run_files(run_root, "bad-fail", "history.jsonl")
    failed = next(e for e in events if e.get("state_to") == "FAILED")
    assert failed["reason"] == line or line in failed["reason"], failed
    took = failed["time"] - history[-1]["time"]
    print(f"last committed step {history[-1]['step']} -> FAILED in {took:.2f}s")
    assert history[-1]["step"] == 4 and took < FAILED_WITHIN_S
    failures = [e for e in events if e["kind"] == "failure"]
    assert len(failures) == 1 and failures[0]["detail"]["detector"] == "bad sample", failures
    assert not [e for e in events if e["kind"] == "retired" or e.get("state_to") == "PAUSED"]
    assert not [e for e in events if e["kind"] == "reshape"], "a replacement joined"


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_one_bad_sample_is_skipped_and_counted(run_root):
    job = ElasticJob(config_from_dict(config("bad-skip", "skip", 10))).start()
    result = job.wait(timeout=180)
    assert result.state == "FINISHED", (result.state, result.cause)
    status = job.status()
    assert status.samples_skipped == 1
    (skipped,) = [e for e in job.events() if e["kind"] == "samples_skipped"]
    assert skipped["detail"]["ids"] == [BAD] and skipped["detail"]["step"] == 5
    assert [r.get("skipped_samples", 0) for r in job.history()] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert not [e for e in job.events() if e["kind"] == "failure"]
