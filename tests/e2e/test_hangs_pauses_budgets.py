"""Hung workers are evicted, a job below workers.min pauses until there is room, and a slot that
keeps failing is retired; status shows each with its cause."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import ray

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import paced, wait_until

REPO = Path(__file__).resolve().parents[2]


def config(name: str, **over) -> dict:
    cfg = {"name": name, "seed": 2,
           "workers": {"count": 3, "cpus": 0.5, "heartbeat_s": 2.0, "hang_timeout_s": 2.0},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 8},
           "optimizer": {"lr": 0.05}, "stop": {"max_steps": 1_000_000}, "eval_every": 0}
    cfg.update(over)
    return paced(cfg)


def failure_events(job: ElasticJob) -> list[dict]:
    return [e for e in job.events() if e["kind"] == "failure"]


def test_sigstopped_worker_is_evicted_by_heartbeat_and_others_go_on(run_root):
    """A stopped process answers nothing: the heartbeat (5 s) evicts it; the step-progress detector is
    set to 600 s, so only the heartbeat can. How long it took is printed (a figure, not a bound). (At 2 s, a
    healthy worker's answer beside a CPU burner has missed it.)"""
    job = ElasticJob(config_from_dict(config("sigstop", workers={"count": 3, "cpus": 0.5, "heartbeat_s": 5.0,
                                                                 "hang_timeout_s": 600.0}))).start()
    job.wait_for(step=21)
    victim = next(m for m in job.status().members if m.slot == "w1")
    stopped_at = time.time()
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        failure = wait_until(lambda: failure_events(job), what="eviction")[0]
        status = wait_until(lambda: (s := job.status()) and any(d.state == "hung" for d in s.departed) and s, what="status")
    finally:
        try:
            os.kill(victim.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    hung = next(d for d in status.departed if d.state == "hung")
    print(f"SIGSTOP -> evicted after {failure['time'] - stopped_at:.2f}s by {failure['detail']['detector']}: {hung.cause}")
    assert failure["detail"]["detector"] == "heartbeat" and failure["detail"]["slot"] == "w1"
    assert hung.slot == "w1" and hung.pid == victim.pid and "heartbeat" in hung.cause
    job.wait_for(step=job.status().step + 20)  # the others go on
    job.stop()
    history = job.history()
    assert [r["step"] for r in history] == list(range(1, len(history) + 1))
    assert any(r["world_size"] == 2 for r in history), "the survivors trained without the hung worker"


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_step_that_never_ends_is_evicted_by_step_progress(run_root):
    """The heartbeat is set to 60 s, so only the step-progress detector (2 s) can evict (a CI run beside a CPU
    burner had a healthy worker's first heartbeat answer miss a 2-s heartbeat and evicted it instead)."""
    job = ElasticJob(config_from_dict(config("endless-step", workers={"count": 3, "cpus": 0.5, "heartbeat_s": 60.0,
                                                                      "hang_timeout_s": 2.0}, faults={"kills": [
        {"slot": "w2", "step": 15, "at": "step", "how": "hang"}]}))).start()
    failure = wait_until(lambda: failure_events(job), what="eviction")[0]
    assert failure["detail"]["detector"] == "step progress" and failure["detail"]["slot"] == "w2"
    status = job.status()
    hung = next(d for d in status.departed if d.slot == "w2")
    print(f"endless step -> {hung.state}: {hung.cause}")
    assert hung.state == "hung" and "computing for" in hung.cause
    job.wait_for(step=status.step + 20)  # the others go on
    job.stop()


@ray.remote(num_cpus=2)
class Blocker:
    def ping(self) -> bool:
        return True


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_workers_placed_but_still_starting_are_not_reported_paused(run_root, monkeypatch, tmp_path):
    """Workers that Ray has placed but whose start is slow (imports, data) keep the job STARTING,
    with how many are up; PAUSED is for workers that cannot be placed. The factory waits until the test
    creates its gate file, after three times `pause_after_s` have passed (the one wait on time here:
    the time is what the coordinator judges by)."""
    monkeypatch.chdir(REPO / "tests" / "workloads")
    gate = tmp_path / "go"
    cfg = config("slow-start", workers={"count": 2, "cpus": 0.5, "pause_after_s": 1.0},
                 workload={"factory": "custom_workload:make", "params": {"start_gate": str(gate)}, "batch_size": 8},
                 stop={"max_steps": 20})
    job = ElasticJob(config_from_dict(cfg)).start()
    time.sleep(3.0)  # past pause_after_s; the factory waits for the gate, however long this took
    status = job.status()
    gate.touch()
    print(f"{status.state}: {status.cause}")
    assert status.state == "STARTING" and "placed" in (status.cause or ""), status.cause
    assert job.wait(timeout=120).state == "FINISHED"
    transitions = [(e["state_from"], e["state_to"]) for e in job.events() if e["kind"] == "transition"]
    assert ("STARTING", "PAUSED") not in transitions, transitions


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_slot_that_always_fails_is_retired_and_the_job_goes_on(run_root, monkeypatch):
    """Ray's side of a start that fails (the workload raises in w2's warm-up): the error reaches the
    slot's cause, each failed worker is killed (its resources and name freed for the next start), and
    the others train on. The budget's rules are in tests/unit/test_coordinator_paths.py."""
    monkeypatch.chdir(REPO / "tests" / "workloads")
    cfg = config("budget", workers={"count": 3, "cpus": 0.5, "failure_budget": 2},
                 workload={"factory": "custom_workload:make", "params": {"n": 1200, "fail_slot": "w2"}, "batch_size": 8},
                 stop={"max_steps": 1_000_000})
    job = ElasticJob(config_from_dict(cfg)).start()
    retired = wait_until(lambda: [e for e in job.events() if e["kind"] == "retired"], 120, "w2 retired")
    result = job.stop()
    status = job.status()
    print(f"{result.state} at step {result.step}; {retired[0]['reason']}")
    assert result.state == "STOPPED" and result.step > 0
    assert len(retired) == 1 and retired[0]["detail"]["slot"] == "w2" and retired[0]["detail"]["failures"] == 2
    w2 = next(m for m in status.members if m.slot == "w2")
    assert w2.state == "retired" and "failure_budget = 2" in w2.cause and "always fails in slot w2" in w2.cause
    assert [r["step"] for r in job.history()] == list(range(1, result.step + 1))
