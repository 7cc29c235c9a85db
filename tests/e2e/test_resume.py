"""Resume after a SIGKILL of the whole `run` process group: same parameters as an uninterrupted run.

In the slow tier, as is its twin with the run kept on S3 (tests/e2e/test_storage.py): the default suite
resumes from S3 with the node's folder gone (the same `--resume` code over the storage interface,
tests/e2e/test_storage.py), restores bit-identical from the newest checkpoint after every member's SIGKILL
(tests/e2e/test_restore.py), and saves, verifies and finds checkpoints on a local disk
(tests/unit/test_checkpoints.py)."""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
import yaml

from actors.runs import runfiles
from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import child_env, sigkill_run_at, start_run

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
# `min` = `count`: every run trains at full width from step 1 (a clean-clone CI run of the S3 twin's killed run
# began without its late second worker, and step 1 summed at world size 1: 2.7e-07 off the reference)
CONFIG = {
    "name": "resume", "seed": 5, "workers": {"count": 2, "min": 2, "cpus": 1},
    "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 16},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0005},
    "checkpoint": {"every_steps": 20}, "stop": {"max_steps": 120}, "eval_every": 0,
}


def params_of(run_dir: Path) -> list[torch.Tensor]:
    state = torch.load(io.BytesIO((run_dir / "model.pt").read_bytes()), weights_only=True)
    return list(state["model"].values())


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def cli(args: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", "run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, **kw)


def test_sigkill_near_70_resumes_from_60_and_matches_uninterrupted(tmp_path, run_root):
    reference = ElasticJob(config_from_dict(dict(CONFIG, name="resume-reference"))).start()  # trains meanwhile

    root = tmp_path / "runs"
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(root))
    env.pop("RAY_ADDRESS", None)  # each `run` starts (and owns) its own local Ray
    config_path = tmp_path / "resume.yaml"
    # 20 steps/s: history reaches the file in reports every 0.25 s, so the kill lands a few steps after
    # the 70 it saw, before the checkpoint at 80 (at 50 steps/s a loaded machine passed 80 first)
    slow = dict(CONFIG, faults={"stragglers": [{"slot": "w0", "delay_s": 0.05}]})
    config_path.write_text(yaml.safe_dump(slow))
    output = tmp_path / "killed-run.log"
    proc = start_run([str(config_path)], REPO, env, output)

    def newest() -> int:
        return max([r["step"] for h in root.glob("resume/*/history.jsonl") for r in runfiles.read_jsonl(h)], default=0)
    sigkill_run_at(proc, newest, 70, output=output)
    killed_at_step = newest()
    assert 70 <= killed_at_step < 80, killed_at_step

    assert reference.wait(timeout=180).state == "FINISHED"
    expected = params_of(reference.run_dir)
    # the resumed runs attach to this session's Ray (a Ray of their own would cost its start each time)
    address = ray.get_runtime_context().gcs_address
    resumed = cli([str(config_path), "--resume", "--address", address], env)
    print(resumed.stdout, resumed.stderr[-2000:])
    assert resumed.returncode == 0 and "resuming from step 60" in resumed.stdout
    runs = sorted(root.glob("resume/*/"), key=lambda p: p.name)
    history = runfiles.read_jsonl(runs[-1] / "history.jsonl")
    assert [r["step"] for r in history] == list(range(61, 121))
    diff = max_diff(params_of(runs[-1]), expected)
    print(f"killed at step {killed_at_step}; resumed from 60 to 120; max abs diff vs uninterrupted: {diff:.2e}")
    assert diff == 0.0, "resume must be bit-identical"

    (newest,) = (runs[-1] / "checkpoints").glob("step-00000120-*.pt")
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    again = cli([str(config_path), "--resume", "--address", address], env)
    print(again.stdout, again.stderr[-2000:])
    assert again.returncode == 0
    assert "skipping checkpoint" in again.stderr and newest.name in again.stderr
    assert "resuming from step 100" in again.stdout
    runs = sorted(root.glob("resume/*/"), key=lambda p: p.name)
    assert max_diff(params_of(runs[-1]), expected) == 0.0
