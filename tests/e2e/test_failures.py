"""With `workers.on_failure: fail`, a worker that dies or raises fails the job at once, with the
cause, leaving nothing behind; no survivor applied the uncommitted step.
(The default, `reshape`, keeps training: tests/e2e/test_elastic.py.)

Every collective here may wait 120 s (`comm.timeout_s`) and each test waits at most 60 s for the job to
end: only the fail-fast path (the coordinator's ending on the death or the error, which kills the
survivors stuck in their collective) can end it in time. How fast it does is a figure of
benchmarks/recovery.py, not a bound here."""
from __future__ import annotations

import os
import signal
import time

import pytest

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import explain, paced, running


def make_job(name: str, kills: list | None = None, steps: int = 400) -> ElasticJob:
    cfg = config_from_dict(paced({
        "name": name,
        "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 64}, "batch_size": 16},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "sync": {"bucket_mb": 0.01}, "stop": {"max_steps": steps}, "eval_every": 0,
        "comm": {"timeout_s": 120}, "faults": {"kills": kills or []},
        "workers": {"count": 3, "cpus": 0.5, "on_failure": "fail"},  # two survivors to agree
        "log_level": "INFO",  # the workers' logs say what a slow ending waited for (`explain`)
    }))
    return ElasticJob(cfg).start()


def failure_of(job: ElasticJob) -> tuple[dict, dict]:
    events = job.events()
    failed = [e for e in events if e.get("state_to") == "FAILED"]
    failures = [e for e in events if e["kind"] == "failure"]
    assert failed and failures, events
    return failures[0], failed[0]


def assert_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, f"processes left behind: {[p for p in pids if running(p)]}"
        time.sleep(0.1)


def assert_survivors_at_last_committed_step(job: ElasticJob, failed: dict, victim: str) -> None:
    survivors = failed["detail"]["survivors"]
    assert victim not in survivors and len(survivors) == 2, survivors
    steps = {s["step"] for s in survivors.values()}
    sums = {s["checksum"] for s in survivors.values()}
    assert len(steps) == 1 and len(sums) == 1, survivors
    assert steps == {job.history()[-1]["step"]}


def test_sigkill_inside_allreduce_fails_the_job_at_once(run_root):
    job = make_job("die-in-allreduce", kills=[{"slot": "w2", "step": 30, "at": "allreduce", "how": "sigkill"}])
    pids = [m.pid for m in job.status().members]
    job.wait_for("fault", timeout=120)
    result = job.wait(timeout=60)
    assert result.state == "FAILED"
    failure, failed = failure_of(job)
    fired = next(e for e in job.events() if e["kind"] == "fault")
    print(f"kill inside all-reduce -> FAILED in {failed['time'] - fired['detail']['fired_at']:.2f}s; cause: {result.cause}")
    # the survivors' failed collective or Ray's notice of the death, whichever the coordinator hears first
    assert failure["detail"]["slot"] == "w2" and failure["detail"]["detector"] in ("actor death", "collective failure")
    assert "w2" in result.cause
    assert_survivors_at_last_committed_step(job, failed, "w2")
    assert [r["step"] for r in job.history()] == list(range(1, len(job.history()) + 1))
    assert_gone(pids)


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_external_sigkill_fails_the_job_at_once(run_root):
    job = make_job("external-kill", steps=100_000)
    job.wait_for(step=20, timeout=120)
    victim = next(m for m in job.status().members if m.slot == "w1")
    pids = [m.pid for m in job.status().members]
    killed_at = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    result = job.wait(timeout=60)
    failure, failed = failure_of(job)
    print(f"external SIGKILL -> FAILED in {failed['time'] - killed_at:.2f}s")
    assert result.state == "FAILED", explain(job, killed_at)
    assert failure["detail"]["slot"] == "w1"
    assert_survivors_at_last_committed_step(job, failed, "w1")
    assert_gone(pids)


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_user_exception_fails_job_with_traceback(run_root):
    job = make_job("user-exception", kills=[{"slot": "w2", "step": 12, "at": "user_exception"}])
    pids = [m.pid for m in job.status().members]
    job.wait_for("fault", timeout=120)
    result = job.wait(timeout=60)
    failure, failed = failure_of(job)
    fired = next(e for e in job.events() if e["kind"] == "fault")
    print(f"user exception -> FAILED in {failed['time'] - fired['detail']['fired_at']:.2f}s")
    assert result.state == "FAILED"
    assert failure["detail"]["slot"] == "w2" and failure["detail"]["detector"] == "task error"
    assert "InjectedFault" in failure["detail"]["traceback"] and "Traceback" in failure["detail"]["traceback"]
    assert "w2" in result.cause
    assert_gone(pids)


BROKEN_FACTORY = '''
def build(**params):
    raise ValueError("the workload cannot be built: no such column 'label'")
'''


def test_a_workload_that_cannot_start_in_any_worker_fails_the_job_with_its_error(run_root, tmp_path, monkeypatch):
    """Every worker's constructor raises: each slot is retired by its failure budget, and then nothing can
    ever start, so the job ends FAILED (not STARTING for ever) with the workers' own exception, type and
    message, in its cause and events."""
    (tmp_path / "broken_workload.py").write_text(BROKEN_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # the workers import from the driver's working directory
    cfg = config_from_dict(paced({
        "name": "cannot-start",
        "workload": {"factory": "broken_workload:build", "batch_size": 16},
        "stop": {"max_steps": 10}, "eval_every": 0,
        "workers": {"count": 2, "max": 4, "cpus": 0.5, "failure_budget": 2},
    }))
    job = ElasticJob(cfg).start()
    result = job.wait(timeout=120)  # a bound on the test only: the hang this guards against never ends
    failed = [e for e in job.events() if e.get("state_to") == "FAILED"]
    print(f"cannot start -> FAILED in {failed[0]['time'] - job.events()[0]['time']:.1f}s" if failed else "")
    assert result.state == "FAILED", (result.state, result.cause)
    assert "ValueError: the workload cannot be built: no such column 'label'" in result.cause, result.cause
    assert "no worker could start" in result.cause
    assert any("ValueError: the workload cannot be built" in e["reason"] for e in job.events() if e["kind"] == "failure")
