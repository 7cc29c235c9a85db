"""The CLI end to end: user workloads from a working directory, user code's exception, a run starting its own
Ray; in the slow tier, the main job and status / stop from other processes (docs/testing.md, "The slow tier")."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray

from orchestrator.job import ElasticJob
from testkit.harness import child_env

REPO = Path(__file__).resolve().parents[2]


def without_repo(env: dict) -> None:
    """The environment's own PYTHONPATH (where Ray may live), without the repository."""
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    else:
        env.pop("PYTHONPATH", None)


def _env(tmp_path: Path) -> dict:
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(tmp_path / "runs"))
    env.pop("RAY_ADDRESS", None)  # a `run` without --address starts its own local Ray
    return env


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_main_job_reaches_095_with_progress_and_summary(tmp_path, ray_session):
    # The README's first command, attached to this session's Ray (CI runs it as written, with a Ray of
    # its own; starting one is tested by the user-workload tests below and by the 'ray start' one)
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", "configs/digits_bsp.yaml", "--address", address],
                          cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.returncode == 0
    assert re.search(r"\[running\] step \d+/600 loss [\d.]+ steps/s", proc.stdout)
    assert "FINISHED: digits-bsp" in proc.stdout
    accuracy = float(re.search(r"accuracy: ([\d.]+)", proc.stdout).group(1))
    step = int(re.search(r"FINISHED: digits-bsp run \S+ at step (\d+)", proc.stdout).group(1))
    events = "".join(p.read_text() for p in (tmp_path / "runs" / "digits-bsp").glob("*/events.jsonl"))
    reached = re.search(r"target reached: accuracy = ([\d.]+)", events)
    print(f"held-out accuracy {accuracy} at step {step}; stop: {reached.group(0) if reached else 'no target'}")
    assert accuracy >= 0.95
    assert reached and float(reached.group(1)) >= 0.97 and step < 600, "the job must stop at its target (0.97)"


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_status_and_stop_from_other_processes(tmp_path, run_root):
    address = ray.get_runtime_context().gcs_address
    config = tmp_path / "long.yaml"
    config.write_text((REPO / "configs" / "digits_bsp.yaml").read_text().replace("name: digits-bsp", "name: cli-long")
                      .replace("max_steps: 600", "max_steps: 1000000").replace("value: 0.97", "value: 1.01")
                      .replace("count: 4", "count: 2"))
    env = _env(tmp_path)
    env["ORCHESTRATOR_RUN_ROOT"] = str(run_root)
    run = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(config), "--address", address],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert time.monotonic() < deadline, "job did not start"
            try:
                if ElasticJob.attach("cli-long").status().step > 5:
                    break
            except Exception:  # noqa: BLE001 - not there yet
                pass
            time.sleep(0.3)
        status = subprocess.run([sys.executable, "-m", "orchestrator", "status", "cli-long", "--address", address],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        print(status.stdout, status.stderr)
        assert status.returncode == 0
        assert "RUNNING" in status.stdout and "membership epoch 1" in status.stdout
        assert re.search(r"^w0\s+0\s+training", status.stdout, re.M) and re.search(r"^w1\s+1\s+training", status.stdout, re.M)
        stop = subprocess.run([sys.executable, "-m", "orchestrator", "stop", "cli-long", "--address", address],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        print(stop.stdout, stop.stderr)
        assert stop.returncode == 0 and "STOPPED" in stop.stdout
        assert run.wait(timeout=60) == 3
        run_id = re.search(r"run (\S+):", stop.stdout + status.stdout).group(1)
        for name in ["cli-long"] + [f"cli-long/{run_id}/w{i}" for i in range(2)]:
            try:
                ray.get_actor(name, namespace="orchestrator")
                raise AssertionError(f"actor {name} still alive after stop returned")
            except ValueError:
                pass
        after = subprocess.run([sys.executable, "-m", "orchestrator", "status", "cli-long", "--address", address],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert after.returncode == 0 and "STOPPED" in after.stdout, after.stdout + after.stderr
    finally:
        if run.poll() is None:
            run.kill()


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_user_workload_from_working_directory(tmp_path, ray_session):
    """Attached to this session's Ray (a run that starts a Ray of its own is the test below's): the
    workers, started by that Ray elsewhere, import the workload from the run's working directory."""
    workdir = REPO / "tests" / "workloads"
    env = _env(tmp_path)
    without_repo(env)  # the workload must come from the working directory alone
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", "custom.yaml", "--address", address], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout[-1500:], proc.stderr[-1500:])
    assert proc.returncode == 0
    assert float(re.search(r"accuracy: ([\d.]+)", proc.stdout).group(1)) > 0.9


def test_a_working_directory_with_its_own_core_actors_and_algorithms_packages_trains(tmp_path, ray_session):
    """A user project with packages named like this project's (`core/`, `actors/`, `algorithms/`, each
    of which fails when imported here): the driver (`python -m orchestrator` puts the working directory
    first) and the Ray processes the job starts (Ray puts it first there too) import this project's, and
    the workload from the directory trains. Before: the driver died importing the user's `core`, and once
    past that the coordinator actor failed to import."""
    workdir = tmp_path / "project"
    workdir.mkdir()
    for name in ("custom_workload.py", "custom.yaml"):
        shutil.copy(REPO / "tests" / "workloads" / name, workdir / name)
    for package in ("core", "actors", "algorithms"):
        (workdir / package).mkdir()
        (workdir / package / "__init__.py").write_text(f"raise ImportError('the project {package} package was imported')\n")
    env = _env(tmp_path)
    without_repo(env)  # this project from its install, as a user has it
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", "custom.yaml", "--address", address], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout[-1500:], proc.stderr[-1500:])
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert float(re.search(r"accuracy: ([\d.]+)", proc.stdout).group(1)) > 0.9


def test_user_code_exception_fails_run_with_exit_1(tmp_path, ray_session):
    workdir = REPO / "tests" / "workloads"
    env = _env(tmp_path)
    without_repo(env)
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", "custom.yaml", "--set",
                           "workload.params.fail_at_step=7", "--address", address], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    print(proc.stdout[-1500:], proc.stderr[-1500:])
    assert proc.returncode == 1
    assert "FAILED" in proc.stdout and "ValueError: user code failed on call 7" in proc.stdout
    events = (next((tmp_path / "runs" / "custom-workload").iterdir()) / "events.jsonl").read_text()
    assert "Traceback" in events and "custom_workload.py" in events


def test_a_run_without_an_address_starts_its_own_ray_where_ray_start_left_an_address(tmp_path):
    """`ray start` writes the cluster's address to <temp dir>/ray/ray_current_cluster, and Ray's
    `init()` without an address connects there: a run that should start its own local Ray would
    instead fail ("num_cpus ... must not be provided") or, worse, land on someone else's cluster."""
    temp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        (temp / "ray").mkdir()
        (temp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")  # a cluster long gone
        env = _env(tmp_path)
        env["RAY_TMPDIR"] = str(temp)
        code = ("import ray\nfrom orchestrator.job import connect\nconnect()\n"
                "print('local', ray.get_runtime_context().gcs_address)\nray.shutdown()\n")
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        print(proc.stdout, proc.stderr[-1500:])
        assert proc.returncode == 0 and proc.stdout.startswith("local ")
        assert "127.0.0.1:1\n" not in proc.stdout
    finally:
        shutil.rmtree(temp, ignore_errors=True)
