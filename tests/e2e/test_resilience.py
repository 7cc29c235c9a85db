"""Beyond one worker: a lost node, and the driver that owns a job (Ctrl-C, SIGKILL, --detach)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch
import yaml

from orchestrator.config import config_from_dict
from orchestrator.job import NAMESPACE, ElasticJob, ensure_token_env
from testkit.harness import child_env, paced, wait_until

REPO = Path(__file__).resolve().parents[2]


def job_config(name: str, **over) -> dict:
    cfg = {"name": name, "seed": 4, "workers": {"count": 3, "cpus": 1, "placement": "spread"},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 8},
           "optimizer": {"lr": 0.05}, "stop": {"max_steps": 1_000_000}, "eval_every": 0}
    cfg.update(over)
    return paced(cfg) if cfg["stop"].get("max_steps", 0) >= 100_000 else cfg


def test_node_loss_survivors_go_on_at_once_and_replacements_land_elsewhere(tmp_path, monkeypatch, _ray_owner):
    """Heartbeats, the step-progress detector and every collective are set to 120 s or more, and the
    test waits 60 s for the survivors' first step without the node: only Ray's notice of the node's
    death can bring it in time. How soon it came is printed (a figure of benchmarks/recovery.py)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # this test needs a multi-node cluster of its own
    monkeypatch.setenv("ORCHESTRATOR_RUN_ROOT", str(tmp_path))
    store = 100 * 2**20
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store})
    nodes = [cluster.add_node(num_cpus=2, object_store_memory=store) for _ in range(2)]
    try:
        ensure_token_env()
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        job = ElasticJob(config_from_dict(job_config(
            "node-loss", workers={"count": 3, "cpus": 1, "placement": "spread", "heartbeat_s": 120.0,
                                  "hang_timeout_s": 600.0, "start_grace_s": 600}, comm={"timeout_s": 120.0}))).start()
        job.wait_for(step=31)
        placed = {m.slot: m.node_id for m in job.status().members}
        victim = next(n for n in nodes if n.node_id in placed.values())
        lost = sorted(slot for slot, node in placed.items() if node == victim.node_id)
        removed_at = time.time()
        cluster.remove_node(victim, allow_graceful=False)
        survivors = 3 - len(lost)
        first = wait_until(lambda: next((r for r in job.history() if r["time"] > removed_at
                                         and r["world_size"] == survivors), None),
                           timeout=60, what="the survivors' first committed step without the lost node")
        loss = next(e for e in job.events() if e["kind"] == "failure")
        print(f"node holding {lost} removed; survivors' next committed step {first['step']} after "
              f"{first['time'] - removed_at:.2f}s at world size {first['world_size']} "
              f"(detector: {loss['detail']['detector']})")
        wait_until(lambda: any(set(lost) <= set(e["detail"]["joiners"]) for e in job.events() if e["kind"] == "reshape"),
                   timeout=90, what="replacements to join")
        status = job.status()
        for slot in lost:
            member = next(m for m in status.members if m.slot == slot)
            assert member.node_id != victim.node_id and member.state == "training"
        step = status.step
        wait_until(lambda: job.status().step > step + 20, what="training after the replacements")
        job.stop()
        history = job.history()
        assert [r["step"] for r in history] == list(range(1, len(history) + 1))
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_processes(node) -> list[psutil.Process]:
    """Every process of a `Cluster` node: its raylet and all it started (workers, agents)."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    procs = [raylet] + raylet.children(recursive=True)
    for infos in node.all_processes.values():
        for info in infos:
            try:
                procs.append(psutil.Process(info.process.pid))
            except psutil.Error:
                pass
    return list({p.pid: p for p in procs}.values())


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_silent_node_survivors_commit_within_two_heartbeats(tmp_path, monkeypatch, _ray_owner):
    """Every process of the node holding a worker is SIGSTOPped: nothing resets a socket, so only the
    heartbeat can tell. The survivors' next committed step must come within 2 x workers.heartbeat_s
    of the freeze, without waiting for a replacement (which may be placed on the frozen node)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("ORCHESTRATOR_RUN_ROOT", str(tmp_path))
    store = 100 * 2**20
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store})
    nodes = [cluster.add_node(num_cpus=2, object_store_memory=store) for _ in range(2)]
    frozen: list[psutil.Process] = []
    heartbeat_s = 2.0
    try:
        ensure_token_env()
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        cfg = job_config("silent-node", workers={"count": 3, "cpus": 1, "placement": "spread", "heartbeat_s": heartbeat_s})
        job = ElasticJob(config_from_dict(cfg)).start()
        wait_until(lambda: job.status().step > 30, what="training")
        placed = {m.slot: m.node_id for m in job.status().members}
        victim = next(n for n in nodes if n.node_id in placed.values())
        lost = sorted(slot for slot, node in placed.items() if node == victim.node_id)
        frozen = _node_processes(victim)
        frozen_at = time.time()
        for proc in frozen:
            proc.suspend()
        survivors = 3 - len(lost)
        first = wait_until(lambda: next((r for r in job.history() if r["time"] > frozen_at
                                         and r["world_size"] == survivors), None),
                           timeout=30, what="the survivors' first committed step without the frozen node")
        failure = next(e for e in job.events() if e["kind"] == "failure")
        print(f"node holding {lost} frozen ({len(frozen)} processes SIGSTOPped); survivors' next committed step "
              f"{first['step']} after {first['time'] - frozen_at:.2f}s (detector: {failure['detail']['detector']}, "
              f"heartbeat_s {heartbeat_s:g})")
        assert first["time"] - frozen_at < 2 * heartbeat_s
        step = first["step"]
        wait_until(lambda: job.status().step > step + 20, what="training after the freeze")
        job.stop()
        history = job.history()
        assert [r["step"] for r in history] == list(range(1, len(history) + 1))
    finally:
        for proc in frozen:
            try:
                proc.kill()
            except psutil.Error:
                pass
        ray.shutdown()
        cluster.shutdown()


def _start_run(tmp_path: Path, run_root: Path, name: str, extra: list[str]) -> tuple[subprocess.Popen, Path]:
    """`run` in its own process group; its output goes to a file (returned), never to a pipe nobody
    reads while the test waits (a full pipe would block the run's prints)."""
    address = ray.get_runtime_context().gcs_address
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job_config(name, workers={"count": 2, "max": 3, "cpus": 0.5})))
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(run_root))
    log = tmp_path / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(path), "--address", address, *extra],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return proc, log


def _exit_code(proc: subprocess.Popen, log: Path, timeout: float) -> int:
    """The run's exit code; if it is still running after `timeout`, its threads' stacks (`run` dumps
    them on SIGUSR1) and output tail are the failure's message."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)  # a moment for the dump; only on this failure's path
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"run still running {timeout:g}s on; its output and stacks:\n{log.read_text()[-6000:]}")


def _attach_when_training(name: str) -> ElasticJob:
    def attached():
        try:
            job = ElasticJob.attach(name)
            return job if job.status().step > 20 else None
        except Exception:  # noqa: BLE001 - not up yet
            return None
    return wait_until(attached, timeout=90, what=f"{name} to train")


def _assert_gone(name: str, run_id: str, slots: list[str]) -> None:
    def gone():
        for actor in [name] + [f"{name}/{run_id}/{s}" for s in slots]:
            try:
                ray.get_actor(actor, namespace=NAMESPACE)
                return False
            except ValueError:
                pass
        return True
    wait_until(gone, timeout=30, what="every actor of the job to be gone")


def test_ctrl_c_stops_gracefully_with_checkpoint_and_exit_130(tmp_path, run_root):
    proc, log = _start_run(tmp_path, run_root, "ctrl-c", [])
    try:
        job = _attach_when_training("ctrl-c")
        os.killpg(proc.pid, signal.SIGINT)
        assert _exit_code(proc, log, 60) == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    status = job.status()
    out = log.read_text()
    print(out[-600:])
    assert status.state == "STOPPED" and "interrupted" in (status.cause or "")
    assert list((job.run_dir / "checkpoints").glob(f"step-{status.step:08d}-*.pt")), "no checkpoint at the stop step"
    assert f"STOPPED: ctrl-c run {job.run_id} at step {status.step}" in out, "the summary after a Ctrl-C"
    assert f"  final model: {job.run_dir / 'model.pt'} (orchestrator.load_model" in out
    assert f"  last checkpoint: {status.checkpoint['path']} (step {status.step}; --resume continues from it)" in out
    _assert_gone("ctrl-c", job.run_id, ["w0", "w1"])


def test_sigkill_of_owning_run_stops_the_job(tmp_path, run_root):
    proc, _ = _start_run(tmp_path, run_root, "owned", [])
    try:
        job = _attach_when_training("owned")
        killed_at = time.time()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    wait_until(lambda: job.status().state == "STOPPED", timeout=30, what="STOPPED")
    stopped = next(e for e in job.events() if e.get("state_to") == "STOPPED")
    print(f"owner SIGKILLed -> STOPPED after {stopped['time'] - killed_at:.2f}s: {stopped['reason']}")
    assert "owned this job" in stopped["reason"]
    assert list((job.run_dir / "checkpoints").glob("step-*.pt"))
    _assert_gone("owned", job.run_id, ["w0", "w1"])


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_detached_job_outlives_launcher_and_is_scaled_and_stopped_elsewhere(tmp_path, run_root):
    proc, log = _start_run(tmp_path, run_root, "detached", ["--detach"])
    assert _exit_code(proc, log, 60) == 0, log.read_text()[-3000:]
    job = _attach_when_training("detached")
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(run_root))
    address = ray.get_runtime_context().gcs_address
    scale = subprocess.run([sys.executable, "-m", "orchestrator", "scale", "detached", "3", "--address", address],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert scale.returncode == 0, scale.stderr
    wait_until(lambda: job.status().world_size == 3 and job.status().state == "RUNNING", timeout=90, what="scale-up")
    stop = subprocess.run([sys.executable, "-m", "orchestrator", "stop", "detached", "--address", address],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0 and "STOPPED" in stop.stdout
    run_id = re.search(r"(\d{8}-\d{6}-[0-9a-f]{4})", str(job.run_dir)).group(1)
    _assert_gone("detached", run_id, ["w0", "w1", "w2"])


def test_coordinator_sigkilled_mid_run_is_restarted_and_carries_on(run_root, s3):
    """Ray restarts the coordinator; the run is kept on S3 (a moto server on 127.0.0.1) and the local run
    folder is deleted with the coordinator (as when Ray restarts it on another node): the new incarnation
    copies the state file, history and events down from the store, re-attaches the live workers (same
    pids), publishes a new membership epoch, fills history from the members, scales up, and stops with no
    gap in history, here and on the store. A driver that attaches afterwards on a node without the run
    folder reads status, history, events and the model from S3. (A restarted coordinator that runs on to
    FINISHED: test_coordinator_dies_right_after_publishing_a_plan.)"""
    from actors.runs import runfiles
    from actors.runs.mirror import read_appended
    from actors.runs.storage import open_storage

    uri = s3.format(prefix="restart")
    cfg = job_config("coordinator-loss", workers={"count": 3, "max": 4, "cpus": 0.5}, stop={"max_steps": 1_000_000},
                     storage=uri, faults={"stragglers": [{"slot": "w0", "delay_s": 0.03}]})
    job = ElasticJob(config_from_dict(cfg)).start()
    storage = open_storage(uri)
    key = f"{job.name}/{job.run_id}"
    wait_until(lambda: len(runfiles.parse_jsonl(read_appended(storage, f"{key}/history.jsonl"))) >= 40, timeout=120,
               what="40 steps of history on S3")
    before = job.status()
    pids = {m.slot: m.pid for m in before.members}
    killed_at = time.time()
    os.kill(before.coordinator_pid, signal.SIGKILL)
    shutil.rmtree(job.run_dir)  # the node's folder goes with it
    after = wait_until(lambda: (s := job.status()).incarnation == 1 and s.state == "RUNNING" and s, timeout=60,
                       what="the restarted coordinator")
    assert after.coordinator_pid != before.coordinator_pid and after.membership_epoch > before.membership_epoch
    job.scale(4)
    wait_until(lambda: (s := job.status()).world_size == 4 and s.state == "RUNNING", timeout=90, what="the scale-up")
    result = job.stop()
    steps = result.step
    assert result.state == "STOPPED" and steps > before.step, result
    history = job.history()
    assert [r["step"] for r in history] == list(range(1, steps + 1)), "history has a gap or a repeat"
    epochs = [r["membership_epoch"] for r in history]
    assert epochs == sorted(epochs) and epochs[-1] > after.membership_epoch, "membership epochs must keep increasing"
    final = job.status()
    assert {m.slot: m.pid for m in final.members if m.slot in pids} == pids, "the workers must not be restarted"
    restart = next(e for e in job.events() if e["kind"] == "restart")
    recovered = next(e for e in job.events() if e["kind"] == "reshape" and e["detail"]["detector"] == "coordinator restart")
    copied = [e for e in job.events() if "copied down from" in e["reason"]]
    assert copied and "coordinator.json" in copied[0]["reason"] and "history.jsonl" in copied[0]["reason"], copied
    during = [r for r in history if killed_at < r["time"] < restart["time"]]
    print(f"coordinator SIGKILLed at step {before.step} with its folder deleted: restarted after "
          f"{restart['time'] - killed_at:.2f}s (workers committed {len(during)} steps meanwhile); {copied[0]['reason']}; "
          f"new epoch {recovered['detail']['membership_epoch']} committed {recovered['detail']['duration_s']:.2f}s "
          f"after the restart began; history 1..{steps}, no gap")
    assert restart["detail"]["reattached"] == ["w0", "w1", "w2"] and restart["detail"]["lost"] == []
    assert restart["time"] - killed_at < 29.0  # docs/elastic.md states 2.9 s
    stored = runfiles.parse_jsonl(read_appended(storage, f"{key}/history.jsonl"))
    assert [r["step"] for r in stored] == list(range(1, steps + 1)), "the store's history has a gap or a repeat"
    assert json.loads(storage.read(f"{key}/status.json"))["state"] == "STOPPED"
    shutil.rmtree(job.run_dir)  # a driver on a node without the folder: everything comes from S3
    attached = ElasticJob.attach(job.name)
    assert attached.status().state == "STOPPED" and attached.status().step == steps
    assert [r["step"] for r in attached.history()] == list(range(1, steps + 1))
    assert any(e["kind"] == "restart" for e in attached.events())
    assert attached.model()(torch.zeros(2, 64)).shape == (2, 10)


def _history_is_complete(job: ElasticJob, last: int) -> list[dict]:
    history = job.history()
    steps = [r["step"] for r in history]
    missing = sorted(set(range(1, last + 1)) - set(steps))
    assert steps == list(range(1, last + 1)), f"history has {len(steps)} records; missing {missing[:10]}..."
    return history


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_coordinator_dies_right_after_publishing_a_plan(run_root):
    """The coordinator publishes a scale-down (plan 2: a new membership epoch) and dies before it
    has saved it; its first restart dies too, as it begins to re-attach. The workers already formed
    that epoch's group; the third incarnation must still know them, take the epoch from them,
    re-form everyone in a newer one, and history must lose nothing."""
    steps = 500
    cfg = job_config("coordinator-publish", workers={"count": 3, "cpus": 0.5}, stop={"max_steps": steps},
                     faults={"coordinator": [{"at": "publish", "version": 2}, {"at": "recover"}],
                             "stragglers": [{"slot": "w0", "delay_s": 0.02}]})
    job = ElasticJob(config_from_dict(cfg)).start()
    wait_until(lambda: job.status().step > 30, what="training")
    try:
        job.scale(2)
    except ray.exceptions.RayActorError:
        pass  # the coordinator died answering it (that is the fault)
    result = job.wait(timeout=240)
    epochs = [r["membership_epoch"] for r in job.history()]
    recovered = next(e for e in job.events() if e["kind"] == "reshape" and e["detail"]["detector"] == "coordinator restart")
    print(f"{result.state} at {result.step}; epochs in history {sorted(set(epochs))}; the restarted coordinator "
          f"published epoch {recovered['detail']['membership_epoch']}")
    assert result.state == "FINISHED" and result.step == steps
    assert [e["detail"]["incarnation"] for e in job.events() if e["kind"] == "restart"] == [2]
    _history_is_complete(job, steps)
    assert recovered["detail"]["membership_epoch"] > 2, "plan 2's epoch was taken: the restart must publish a newer one"
    assert epochs == sorted(epochs) and epochs[-1] == recovered["detail"]["membership_epoch"]


def test_coordinator_dies_right_after_deciding_to_stop(run_root):
    """The time limit is reached, the coordinator saves STOPPING and dies. The members stop at the
    stop step they were sent; the new incarnation must collect every step they committed
    (including those reported to the dead incarnation) before it ends the job."""
    cfg = job_config("coordinator-stop", workers={"count": 2, "cpus": 0.5}, stop={"time_s": 3.0},
                     faults={"coordinator": [{"at": "stop"}], "stragglers": [{"slot": "w0", "slowdown": 3.0}]})
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=120)
    final = torch.load(io.BytesIO((job.run_dir / "model.pt").read_bytes()), weights_only=True)["step"]
    print(f"{result.state} at step {result.step}; the members stopped at step {final}")
    assert result.state == "FINISHED" and result.step == final
    _history_is_complete(job, final)
