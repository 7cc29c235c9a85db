"""Bad input never starts Ray and never writes anything: exit 2 and one line naming the key."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import cli

REPO = Path(__file__).resolve().parents[2]
GOOD = """\
name: ok
workers: {count: 2}
workload: {factory: "orchestrator.workloads.digits:mlp", batch_size: 8}
stop: {max_steps: 5}
"""

# (case id, YAML text, expected text in the message)
CASES = [
    ("yaml-syntax", "name: x\nworkers: {count: 2\nstop: {max_steps: 1}\n", "line 3, column"),
    ("top-level-list", "- a\n- b\n", "top level must be a mapping"),
    ("empty-file", "", "empty"),
    ("unknown-top-key", GOOD + "wrkers: {count: 2}\n", "wrkers: unknown key"),
    ("unknown-nested-key", GOOD.replace("count: 2", "count: 2, cnt: 3"), "workers.cnt: unknown key"),
    ("wrong-type", GOOD.replace("count: 2", "count: four"), "workers.count: expected an integer"),
    ("bool-for-int", GOOD.replace("count: 2", "count: true"), "workers.count: expected an integer"),
    ("zero-workers", GOOD.replace("count: 2", "count: 0"), "workers.count: must be at least 1"),
    ("negative-workers", GOOD.replace("count: 2", "count: -2"), "workers.count"),
    ("min-above-max", GOOD.replace("count: 2", "count: 2, min: 3, max: 2"), "workers.min"),
    ("count-outside-bounds", GOOD.replace("count: 2", "count: 5, max: 4"), "workers.count"),
    ("zero-batch", GOOD.replace("batch_size: 8", "batch_size: 0"), "workload.batch_size"),
    ("negative-lr", GOOD + "optimizer: {lr: -0.1}\n", "optimizer.lr: must be positive"),
    ("unknown-optimizer", GOOD + "optimizer: {name: lamb}\n", "optimizer.name"),
    ("unknown-policy", GOOD + "sync: {policy: gossip}\n", "sync.policy: unknown policy"),
    ("foreign-knob", GOOD + "sync: {policy: bsp, s: 3}\n", "sync.s: is not a knob"),
    ("unimportable-module", GOOD.replace("orchestrator.workloads.digits:mlp", "no_such_module:make"),
     "workload.factory: cannot import module"),
    ("missing-function", GOOD.replace("digits:mlp", "digits:nope"), "workload.factory: module"),
    ("factory-without-colon", GOOD.replace("orchestrator.workloads.digits:mlp", "orchestrator.workloads.digits"),
     "workload.factory"),
    ("missing-name", GOOD.replace("name: ok\n", ""), "name: missing"),
    ("bad-name", GOOD.replace("name: ok", "name: 'has space'"), "name:"),
    ("no-stop-condition", GOOD.replace("stop: {max_steps: 5}", "stop: {}"), "stop.max_steps"),
    ("kill-unknown-slot", GOOD + "faults: {kills: [{slot: w9, step: 3}]}\n", "faults.kills[0].slot"),
    ("zero-timeout", GOOD + "comm: {timeout_s: 0}\n", "comm.timeout_s"),
    ("huge-timeout", GOOD + "comm: {timeout_s: 1e300}\n", "comm.timeout_s: must lie in [0.1, 86400] s"),
    ("nan-lr", GOOD + "optimizer: {lr: .nan}\n", "optimizer.lr: must be a finite number"),
    ("tiny-heartbeat", GOOD.replace("count: 2", "count: 2, heartbeat_s: 1e-9"), "workers.heartbeat_s: must lie in"),
    ("huge-workers-max", GOOD.replace("count: 2", "count: 2, max: 3000000"), "workers.max: at most 10000"),
    ("unknown-codec", GOOD + "compression: {codec: zip}\n", "compression.codec"),
    ("bad-placement", GOOD.replace("count: 2", "count: 2, placement: everywhere"), "workers.placement"),
]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Ray must not start and nothing may be written: both are made to fail loudly."""
    import ray

    from orchestrator import job

    def boom(*_a, **_k):
        raise AssertionError("Ray was started for bad input")

    monkeypatch.setattr(ray, "init", boom)
    monkeypatch.setattr(job.ElasticJob, "start", boom)
    root = tmp_path / "runs"
    root.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("ORCHESTRATOR_RUN_ROOT", str(root))
    monkeypatch.setenv("HOME", str(home))
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    return {"root": root, "home": home, "cfg": cfg_dir}


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = cli.main(args)
    err = capsys.readouterr().err
    return code, err


def assert_one_line(err: str, expected: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert expected in lines[0], err


def assert_nothing_written(sandbox: dict, config_file: Path | None) -> None:
    assert not any(sandbox["root"].iterdir())
    assert not any(sandbox["home"].iterdir())
    expected = {config_file.name} if config_file else set()
    assert {p.name for p in sandbox["cfg"].iterdir()} == expected


@pytest.mark.parametrize("case,text,expected", CASES, ids=[c[0] for c in CASES])
def test_malformed_config_exits_2_with_one_line(sandbox, capsys, case, text, expected):
    path = sandbox["cfg"] / "job.yaml"
    path.write_text(text)
    code, err = run_cli(["run", str(path)], capsys)
    assert code == 2
    assert_one_line(err, expected)
    assert_nothing_written(sandbox, path)


def test_missing_file(sandbox, capsys):
    code, err = run_cli(["run", str(sandbox["cfg"] / "absent.yaml")], capsys)
    assert code == 2
    assert_one_line(err, "file not found")
    assert_nothing_written(sandbox, None)


@pytest.mark.parametrize("override,expected", [
    ("workers.count=abc", "workers.count: expected an integer"),
    ("workers.count", "expected key.sub=value"),
    ("optimizer.nesterov=true", "optimizer.nesterov"),
    ("workers.count.x=1", "workers.count: is not a mapping"),
])
def test_bad_set_override(sandbox, capsys, override, expected):
    path = sandbox["cfg"] / "job.yaml"
    path.write_text(GOOD)
    code, err = run_cli(["run", str(path), "--set", override], capsys)
    assert code == 2
    assert_one_line(err, expected)
    assert_nothing_written(sandbox, path)


def test_bad_arguments(sandbox, capsys):
    code, err = run_cli(["run"], capsys)
    assert code == 2
    assert_one_line(err, "arguments:")
    code, err = run_cli(["launch", "x.yaml"], capsys)
    assert code == 2
    assert_one_line(err, "arguments:")


def test_resume_without_checkpoint_and_detach_without_cluster(sandbox, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = sandbox["cfg"] / "job.yaml"
    path.write_text(GOOD)
    code, err = run_cli(["run", str(path), "--resume"], capsys)
    assert code == 2
    assert_one_line(err, "--resume: no valid checkpoint")
    code, err = run_cli(["run", str(path), "--detach"], capsys)
    assert code == 2
    assert_one_line(err, "--detach")
    assert_nothing_written(sandbox, path)


def test_subprocess_exit_code_and_no_ray_session(tmp_path):
    """The real entry point: exit status 2, one stderr line, and no Ray session directory created."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("count: 2", "count: 0"))
    ray_tmp = tmp_path / "raytmp"
    ray_tmp.mkdir()
    env = dict(os.environ, HOME=str(tmp_path), TMPDIR=str(ray_tmp), RAY_TMPDIR=str(ray_tmp),
               ORCHESTRATOR_RUN_ROOT=str(tmp_path / "runs"))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(bad)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "workers.count" in proc.stderr
    assert proc.stdout == ""
    assert not any(ray_tmp.iterdir()) and not (tmp_path / "runs").exists()


def test_a_gpu_the_local_ray_lacks_is_refused_at_once_not_waited_for(tmp_path):
    """`--set workers.gpus=1` on a machine without a GPU, with the local Ray the run starts itself (no
    autoscaler can add one): exit 2 at once, naming the key, what a worker asks and what the machine
    has, instead of `[paused] ... world 0` until killed."""
    good = tmp_path / "job.yaml"
    good.write_text(GOOD)
    env = dict(os.environ, HOME=str(tmp_path), ORCHESTRATOR_RUN_ROOT=str(tmp_path / "runs"), CUDA_VISIBLE_DEVICES="")
    env.pop("RAY_ADDRESS", None)
    # the bound is on the test only: the wait this guards against never ends
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(good), "--set", "workers.gpus=1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-500:])
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "workers.gpus" in proc.stderr and "has 0 GPUs" in proc.stderr, proc.stderr


def _checkpoint(root: Path, run_id: str, step: int, params: dict) -> None:
    from actors.runs import checkpoints

    fp, described = checkpoints.fingerprint("orchestrator.workloads.digits:mlp", params)
    checkpoints.save(root / "ok" / run_id, step, f"state {run_id} {step}".encode(), keep=3, fingerprint=fp,
                     workload=described)


def _resumed_from(sandbox: dict, monkeypatch, argv: list[str], capsys) -> tuple[int, str, str]:
    """What `run` would start from (the job itself is not started: `_run` is replaced)."""
    chosen = {}
    monkeypatch.setattr(cli, "_run", lambda config, args, resume_from: chosen.setdefault("from", resume_from) and 0)
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, chosen.get("from") or "", captured.err


def test_resume_continues_the_newest_run_not_an_older_one_that_got_further(sandbox, capsys, monkeypatch):
    path = sandbox["cfg"] / "job.yaml"
    path.write_text(GOOD)
    _checkpoint(sandbox["root"], "20261101-100000-aaaa", 60, {})
    _checkpoint(sandbox["root"], "20261102-100000-bbbb", 20, {})
    code, chosen, err = _resumed_from(sandbox, monkeypatch, ["run", str(path), "--resume"], capsys)
    assert code == 0 and "20261102-100000-bbbb" in chosen and "step-00000020-" in chosen, (chosen, err)
    code, chosen, err = _resumed_from(sandbox, monkeypatch, ["run", str(path), "--resume", "20261101-100000-aaaa"], capsys)
    assert code == 0 and "20261101-100000-aaaa" in chosen and "step-00000060-" in chosen, (chosen, err)


def test_resume_refuses_a_checkpoint_of_another_workload_with_one_line(sandbox, capsys, monkeypatch):
    path = sandbox["cfg"] / "job.yaml"
    path.write_text(GOOD)
    _checkpoint(sandbox["root"], "20261101-100000-aaaa", 60, {"hidden": 256})  # GOOD's model has the default width
    code, chosen, err = _resumed_from(sandbox, monkeypatch, ["run", str(path), "--resume"], capsys)
    assert code == 2 and not chosen
    assert_one_line(err, "--resume: the checkpoint at step 60 of run 20261101-100000-aaaa was written by another workload")
    code, _, err = _resumed_from(sandbox, monkeypatch, ["run", str(path), "--resume", "no-such-run"], capsys)
    assert code == 2
    assert_one_line(err, "--resume: no valid checkpoint")
