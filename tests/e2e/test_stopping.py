"""Stopping a job from every state it can be in: PAUSED after a death, STOPPING when a member
dies, stalled with every member stuck. Each ends with the survivors' committed state saved
(final model and checkpoint) and no actor left behind."""
from __future__ import annotations

import time

import pytest

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import running, wait_until


def config(name: str, **over) -> dict:
    cfg = {"name": name, "seed": 3,
           "workers": {"count": 3, "cpus": 0.5, "heartbeat_s": 2.0},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 8},
           "optimizer": {"lr": 0.05}, "stop": {"max_steps": 1_000_000}, "eval_every": 0}
    cfg.update(over)
    return cfg


def assert_saved_at(job: ElasticJob, step: int) -> None:
    history = job.history()
    assert [r["step"] for r in history] == list(range(1, step + 1)), "history must end at the stop step"
    assert (job.run_dir / "model.pt").exists(), "no final model"
    assert list((job.run_dir / "checkpoints").glob(f"step-{step:08d}-*.pt")), f"no checkpoint at step {step}"
    forced = [e for e in job.events() if "did not stop" in e["reason"]]
    assert not forced, forced


def assert_gone(pids: list[int], within: float = 1.0) -> None:
    alive = lambda: [p for p in pids if running(p)]  # noqa: E731
    deadline = time.monotonic() + within
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(), f"worker processes still alive after stop() returned: {alive()}"


def test_stop_of_a_stalled_job_returns_only_when_its_workers_are_gone(run_root):
    """Every member's step 11 never ends (nothing is evicted): the stop cannot happen at a step,
    so the coordinator kills the members; `stop()` returns only once their processes are gone."""
    hang = [{"slot": f"w{i}", "step": 10, "at": "step", "how": "hang"} for i in range(3)]
    cfg = config("stop-stalled", workers={"count": 3, "cpus": 0.5, "hang_timeout_s": 600.0},
                 comm={"timeout_s": 2}, faults={"kills": hang})
    job = ElasticJob(config_from_dict(cfg)).start()
    seen = 0
    for _ in range(3):  # each member's hang is recorded as it fires: every member hangs in step 11 now
        seen = job.wait_for("fault", timeout=120, since=seen)["index"] + 1
    pids = [m.pid for m in job.status().members]
    status = job.stop(timeout=60)
    print(f"stalled job: {status.state}, cause {status.cause}")
    assert status.state == "STOPPED"
    assert_gone(pids, within=0.5)


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_elapsed_is_the_run_time_not_the_time_until_wait(run_root):
    """`elapsed_s` is the coordinator's own span, from `start()` to the job's end: not the time until a
    late `wait()` (the test's own clock only bounds it from above)."""
    started = time.time()
    job = ElasticJob(config_from_dict(config("elapsed", stop={"max_steps": 30}))).start()
    wait_until(lambda: job.status().state == "FINISHED", what="FINISHED")
    status = job.status()
    ran = time.time() - started
    time.sleep(2.0)  # wait() called late must not count this
    result = job.wait()
    print(f"elapsed_s {result.elapsed_s:.2f}s, start() to FINISHED seen {ran:.2f}s")
    assert result.elapsed_s == status.ended_at - status.started_at
    assert status.started_at >= started and result.elapsed_s <= ran
