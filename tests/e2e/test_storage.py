"""Runs kept on S3 (a moto server on 127.0.0.1, started here): checkpoints, `--resume` from them after
the whole run and its local folder are gone, and the bad-storage exits (in process). A coordinator that
restarts with its node's folder lost and carries on from the store: tests/e2e/test_resilience.py."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
import yaml

from actors.runs import runfiles
from actors.runs.mirror import read_appended
from actors.runs.storage import open_storage
from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import child_env, sigkill_run_at, start_run

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (the test extra)")
REPO = Path(__file__).resolve().parents[2]
# `min` = `count`: every run trains at full width from step 1 (a clean-clone CI run's killed run began
# without its late second worker, and step 1 summed at world size 1: 2.7e-07 off the reference)
CONFIG = {
    "name": "resume-s3", "seed": 5, "workers": {"count": 2, "min": 2, "cpus": 1},
    "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 16},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0005},
    "checkpoint": {"every_steps": 20}, "stop": {"max_steps": 120}, "eval_every": 0,
}


def params(blob: bytes) -> list[torch.Tensor]:
    return list(torch.load(io.BytesIO(blob), weights_only=True)["model"].values())


def runs_in(storage, job: str) -> list[str]:
    return sorted(key for key, size in storage.list(job, recursive=False) if size < 0)


def cli(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", "run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # a CLI run with a Ray of its own, a reference job and a resumed run: docs/testing.md, "Moved to the slow tier"
def test_a_run_killed_resumes_from_s3_bit_identical(tmp_path, run_root, s3):
    """BSP, checkpoints every 20 steps to S3; the whole `run` process group SIGKILLed at step 70 or
    later (wherever the kill lands), and its local run folder deleted: `--resume` finds the newest
    checkpoint the store holds and ends bit-identical to an uninterrupted run. (A torn checkpoint object
    skipped with a warning: tests/unit/test_storage_layer.py, on an in-memory store, and
    tests/unit/test_checkpoints.py, on disk.)"""
    uri = s3.format(prefix="resume")
    storage = open_storage(uri)
    reference = ElasticJob(config_from_dict(dict(CONFIG, name="resume-s3-reference"))).start()  # trains meanwhile

    root = tmp_path / "runs"
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(root))
    env.pop("RAY_ADDRESS", None)
    config_path = tmp_path / "resume.yaml"
    # 10 steps/s: the kill lands well before the run's end at 120
    slow = dict(CONFIG, storage=uri, faults={"stragglers": [{"slot": "w0", "delay_s": 0.1}]})
    config_path.write_text(yaml.safe_dump(slow))
    output = tmp_path / "killed-run.log"
    proc = start_run([str(config_path)], REPO, env, output)

    def newest() -> int:  # the local history shows a step first (the store's copy follows within 1 s)
        return max([r["step"] for h in root.glob("resume-s3/*/history.jsonl") for r in runfiles.read_jsonl(h)], default=0)
    sigkill_run_at(proc, newest, 70, output=output)
    killed_at = newest()
    first = runs_in(storage, "resume-s3")
    assert len(first) == 1, storage.list("resume-s3")
    stored = sorted(int(key.rsplit("step-", 1)[1][:8]) for key, _ in storage.list(f"{first[0]}/checkpoints", recursive=False)
                    if key.endswith(".json"))  # a checkpoint counts once its manifest is stored
    start = stored[-1]
    assert 60 <= start < 120 and start <= killed_at, (stored, killed_at)
    shutil.rmtree(root)  # the node's disk is gone: only the store has the run

    assert reference.wait(timeout=180).state == "FINISHED"
    expected = params((reference.run_dir / "model.pt").read_bytes())
    address = ray.get_runtime_context().gcs_address
    resumed = cli([str(config_path), "--resume", "--address", address], env)
    print(resumed.stdout, resumed.stderr[-2000:])
    assert resumed.returncode == 0 and f"resuming from step {start}" in resumed.stdout and "s3://" in resumed.stdout
    second = [r for r in runs_in(storage, "resume-s3") if r not in first]
    assert len(second) == 1, runs_in(storage, "resume-s3")
    history = runfiles.parse_jsonl(read_appended(storage, f"{second[0]}/history.jsonl"))
    assert [r["step"] for r in history] == list(range(start + 1, 121)), "the store's history of the resumed run"
    diff = max(float((a - b).abs().max()) for a, b in zip(params(storage.read(f"{second[0]}/model.pt")), expected))
    print(f"killed at step {killed_at}; local folder deleted; resumed from S3 at {start} to 120; max abs diff {diff:.2e}")
    assert diff == 0.0, "resume from S3 must be bit-identical"


@pytest.mark.parametrize("case", ["unreachable", "no bucket", "no credentials", "unknown scheme", "unknown option"])
def test_bad_storage_exits_2_with_one_line_naming_storage_before_ray_starts(tmp_path, s3, case, monkeypatch, capsys):
    """`python -m orchestrator run`'s main, in this process: Ray's start and the job's start are made to
    fail loudly, and nothing may be written (the subprocess' own exit code is
    tests/e2e/test_cli_bad_input.py::test_subprocess_exit_code_and_no_ray_session's)."""
    from orchestrator import cli
    from orchestrator import job as job_module

    endpoint = s3.split("endpoint_override=")[1].split("&")[0]
    uri = {"unreachable": "s3://runs/x?endpoint_override=http://127.0.0.1:1&scheme=http&connect_timeout=1",
           "no bucket": f"s3://no-such-bucket/x?endpoint_override={endpoint}&scheme=http",
           "no credentials": f"s3://runs/x?endpoint_override={endpoint}&scheme=http",
           "unknown scheme": "nosuchfs://bucket/x",
           "unknown option": f"s3://runs/x?endpoint={endpoint}"}[case]

    def boom(*_a, **_k):
        raise AssertionError("Ray or the job was started before the storage was checked")
    monkeypatch.setattr(ray, "init", boom)
    monkeypatch.setattr(job_module.ElasticJob, "start", boom)
    monkeypatch.setenv("ORCHESTRATOR_RUN_ROOT", str(tmp_path / "runs"))
    monkeypatch.setenv("HOME", str(tmp_path))
    if case == "no credentials":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    config_path = tmp_path / "bad.yaml"
    config_path.write_text(yaml.safe_dump(dict(CONFIG, name="bad-storage", storage=uri)))
    code = cli.main(["run", str(config_path)])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    print(case, lines)
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: storage:"), lines
    assert not (tmp_path / "runs").exists(), "something was written before the check"
    assert "testing" not in lines[0], "a credential in the message"


@pytest.mark.slow  # three Ray nodes on two cores, and a node removal: about a minute
def test_the_coordinators_node_removed_it_restarts_on_another_node_from_s3(tmp_path, s3):
    """A three-node cluster (tests/e2e/s3_cluster_job.py): the coordinator may run on nodes a and b;
    its node is removed at step 50 and its local folder deleted; Ray restarts it on the other node,
    which copies the run down from S3; the job finishes with history 1..400, no gap, no repeat."""
    out = tmp_path / "out.json"
    env = child_env(REPO)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "e2e" / "s3_cluster_job.py"), s3.format(prefix="cluster"),
                           str(tmp_path / "runs"), str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-2000:], proc.stderr[-3000:])
    report = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in report.items() if k != "history"}))
    assert proc.returncode == 0, report
    assert report["state"] == "FINISHED" and report["step"] == report["steps"], report
    assert report["second_node"] != report["first_node"], "the coordinator did not move"
    assert report["copied"] and "s3://" in report["copied"][0], report["copied"]
    assert report["history"] == list(range(1, report["steps"] + 1)), "history has a gap or a repeat"


ACCESS_KEY, SECRET_KEY = "AKIAEXAMPLELEAKCHECK1", "s3cr3t-value-that-must-never-be-stored"


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_credentials_in_the_storage_uri_leave_no_copy_anywhere(tmp_path, run_root, s3, capfd, monkeypatch):
    """`?access_key=...&secret_key=...` in the storage URI: the run works, and neither value is found in
    any file of the run folder, any object of the bucket, Ray's KV store, or the output. Nor is the
    rendezvous signing key in the bucket (it stays on the coordinator's node and in Ray's KV store)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    from actors.runs.runfiles import KV_NAMESPACE

    for name in ("ORCHESTRATOR_STORAGE_ACCESS_KEY", "ORCHESTRATOR_STORAGE_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever the driver sets
    uri = s3.format(prefix="creds") + f"&access_key={ACCESS_KEY}&secret_key={SECRET_KEY}"
    cfg = config_from_dict(dict(CONFIG, name="creds-s3", storage=uri, stop={"max_steps": 30},
                                checkpoint={"every_steps": 10}))
    job = ElasticJob(cfg).start()
    result = job.wait(timeout=300)
    assert result.state == "FINISHED", result.cause
    leaks = []
    for path in Path(job.run_dir).rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            leaks += [f"run folder {path.name}: {what}" for what, value in (("access key", ACCESS_KEY), ("secret key", SECRET_KEY))
                      if value.encode() in data]
    storage = open_storage(s3.format(prefix="creds"))
    objects = [key for key, size in storage.list("") if size >= 0]
    assert any(key.endswith("coordinator.json") for key in objects), objects
    secret = json.loads((Path(job.run_dir) / "coordinator.json").read_text()).get("secret")
    for key in objects:
        data = storage.read(key)
        leaks += [f"bucket {key}: {what}" for what, value in (("access key", ACCESS_KEY), ("secret key", SECRET_KEY))
                  if value.encode() in data]
        if key.endswith("coordinator.json") and json.loads(data).get("secret"):
            leaks.append(f"bucket {key}: the rendezvous signing key")
    if secret:
        leaks.append("run folder coordinator.json: the rendezvous signing key (the mirror uploads the state file)")
    for key in _internal_kv_list("", namespace=KV_NAMESPACE):
        value = _internal_kv_get(key, namespace=KV_NAMESPACE) or b""
        leaks += [f"Ray KV {key!r}: {what}" for what, v in (("access key", ACCESS_KEY), ("secret key", SECRET_KEY))
                  if v.encode() in value]
    out, err = capfd.readouterr()
    leaks += [f"output: {what}" for what, v in (("access key", ACCESS_KEY), ("secret key", SECRET_KEY)) if v in out + err]
    assert not leaks, leaks


def test_resume_after_an_older_run_that_got_further_continues_the_newer_run(tmp_path, run_root, s3, capsys):
    """An older run reached step 60, a newer one (started fresh) step 20, both with checkpoints on S3; the
    node's run folder is then deleted: `run --resume` finds the runs on the store alone and continues from
    the newer run's step 20, not the older run's 60."""
    from orchestrator import cli

    uri = s3.format(prefix="lineage")
    base = dict(CONFIG, name="lineage", storage=uri, checkpoint={"every_steps": 20})
    for steps in (60, 20):
        result = ElasticJob(config_from_dict(dict(base, stop={"max_steps": steps}))).start().wait(timeout=180)
        assert result.state == "FINISHED" and result.step == steps, result
    shutil.rmtree(Path(result.run_dir).parent)  # the node's disk is gone: only the store has the runs
    config_path = tmp_path / "lineage.yaml"
    config_path.write_text(yaml.safe_dump(dict(base, stop={"max_steps": 30})))
    assert cli.main(["run", str(config_path), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resuming from step 20 of run" in out, out
    runs = runs_in(open_storage(uri), "lineage")
    history = runfiles.parse_jsonl(read_appended(open_storage(uri), f"{runs[-1]}/history.jsonl"))
    assert [r["step"] for r in history] == list(range(21, 31)), [r["step"] for r in history]
