"""Stopping a job from every state it can be in: PAUSED after a death, STOPPING when a member
dies, stalled with every member stuck. Each ends with the survivors' committed state saved
(final model and checkpoint) and no actor left behind."""
from __future__ import annotations

import time

import psutil

from actors.testing import wait_until
from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob


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
    assert list((job.run_dir / "checkpoints").glob(f"step-{step:08d}.pt")), f"no checkpoint at step {step}"
    forced = [e for e in job.events() if "did not stop" in e["reason"]]
    assert not forced, forced


def assert_gone(pids: list[int], within: float = 1.0) -> None:
    alive = lambda: [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]  # noqa: E731
    deadline = time.monotonic() + within
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(), f"worker processes still alive after stop() returned: {alive()}"


def test_stop_while_paused_saves_the_survivors_state(run_root):
    """A death takes the job below workers.min and its slot is retired (no replacement), so the
    job stays PAUSED. A stop then stops the survivors at their committed step with a model."""
    cfg = config("stop-paused", workers={"count": 3, "min": 3, "cpus": 0.5, "failure_budget": 1},
                 faults={"kills": [{"slot": "w1", "step": 20, "at": "step"}]})
    job = ElasticJob(config_from_dict(cfg)).start()
    paused = wait_until(lambda: (s := job.status()).state == "PAUSED" and s, what="PAUSED after the death")
    pids = [m.pid for m in paused.members]
    started = time.monotonic()
    status = job.stop()
    took = time.monotonic() - started
    print(f"stop while PAUSED at step {paused.step}: {status.state} at step {status.step} in {took:.2f}s")
    assert status.state == "STOPPED" and status.step >= paused.step
    assert took < 5.0, f"stop took {took:.1f}s"
    assert_saved_at(job, status.step)
    assert_gone(pids)


def test_a_death_while_stopping_keeps_the_stop(run_root):
    """w2's step 21 never ends; the others wait in step 21's all-reduce. The stop names step 20
    or 21 (rank 0 reports in batches); then w2 is evicted (step progress) and the survivors
    re-form: the new plan must still carry the stop, not train on until the coordinator gives up
    and kills them."""
    cfg = config("stop-death", workers={"count": 3, "cpus": 0.5, "heartbeat_s": 2.0, "hang_timeout_s": 2.0},
                 comm={"timeout_s": 30}, faults={"kills": [{"slot": "w2", "step": 20, "at": "step", "how": "hang"}]})
    job = ElasticJob(config_from_dict(cfg)).start()
    wait_until(lambda: any(e["kind"] == "fault" for e in job.events()), what="w2's step to hang")
    started = time.monotonic()  # w2 is evicted about 2 s from now: the stop comes first
    status = job.stop()
    took = time.monotonic() - started
    evicted = [e for e in job.events() if e["kind"] == "failure"]
    print(f"stop at step 21 with w2 hung: {status.state} at step {status.step} in {took:.2f}s; "
          f"evictions {[e['detail']['detector'] for e in evicted]}")
    assert evicted and evicted[0]["detail"]["slot"] == "w2"
    assert status.state == "STOPPED" and status.step in (20, 21)
    assert took < 10.0, f"stop took {took:.1f}s"
    assert_saved_at(job, status.step)


def test_stop_of_a_stalled_job_returns_only_when_its_workers_are_gone(run_root):
    """Every member's step 11 never ends (nothing is evicted): the stop cannot happen at a step,
    so the coordinator kills the members; `stop()` returns only once their processes are gone."""
    hang = [{"slot": f"w{i}", "step": 10, "at": "step", "how": "hang"} for i in range(3)]
    cfg = config("stop-stalled", workers={"count": 3, "cpus": 0.5, "hang_timeout_s": 600.0},
                 comm={"timeout_s": 2}, faults={"kills": hang})
    job = ElasticJob(config_from_dict(cfg)).start()
    wait_until(lambda: job.status().step >= 1, what="training")
    time.sleep(2.0)  # every member hangs in step 11 by now
    pids = [m.pid for m in job.status().members]
    status = job.stop(timeout=60)
    print(f"stalled job: {status.state}, cause {status.cause}")
    assert status.state == "STOPPED"
    assert_gone(pids, within=0.5)


def test_elapsed_is_the_run_time_not_the_time_until_wait(run_root):
    started = time.time()
    job = ElasticJob(config_from_dict(config("elapsed", stop={"max_steps": 30}))).start()
    wait_until(lambda: job.status().state == "FINISHED", what="FINISHED")
    ran = time.time() - started
    time.sleep(5.0)  # wait() called late must not count this
    result = job.wait()
    print(f"elapsed_s {result.elapsed_s:.2f}s, start() to FINISHED seen {ran:.2f}s")
    assert ran - 1.0 < result.elapsed_s <= ran + 0.1
