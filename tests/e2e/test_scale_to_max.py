"""A scale to `workers.max` with a hot spare, on the local Ray a job starts for itself (`connect` sizes it
for `workers.max` plus `workers.spares`): made before the spare is ready, the joiner waits for the spare
(no new actor, which the cluster may have no room for) and takes it as soon as it is ready, and `scale()`
returns once it has joined; made with a ready spare, the new world size is reached at once, ten times of
ten. The spare's start is held by its workload (tests/workloads/gated_spares.py) until the test creates
a gate file, so that "before the spare is ready" is a fact, not a race. The join times are printed (the
figure `benchmarks/recovery.py --spares 1` reports) and bounded once, widely: the bound is the mechanism
(a ready spare's join is one adoption and one plan; a new actor's start takes seconds)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import paced, wait_until

REPO = Path(__file__).resolve().parents[2]
JOIN_BOUND_S = 0.5


def member(job: ElasticJob, slot: str):
    return next((m for m in job.status().members if m.slot == slot), None)


def joins_w2(event: dict) -> bool:
    return event["kind"] == "reshape" and event["detail"]["joiners"] == ["w2"]


# joins within 0.5 s: a time, measured alone (beside the other test process one took 0.92 s); in the slow tier
# (the figure is benchmarks/recovery.py --spares 1's): the default tier's tests of its mechanism are in
# docs/testing.md, "Moved to the slow tier"
@pytest.mark.slow
@pytest.mark.exclusive
def test_a_scale_to_max_takes_the_hot_spare_as_soon_as_it_is_ready(tmp_path, monkeypatch, _ray_owner):
    if ray.is_initialized():
        ray.shutdown()  # the job starts the local Ray a user gets (the suite's has 8 CPUs)
    monkeypatch.setenv("ORCHESTRATOR_RUN_ROOT", str(tmp_path))
    monkeypatch.chdir(REPO / "tests" / "workloads")
    gate = tmp_path / "spares-may-start"
    cfg = paced({"name": "scale-to-max", "seed": 0, "workers": {"count": 2, "min": 1, "max": 3, "spares": 1},
                 "workload": {"factory": "gated_spares:make", "params": {"gate": str(gate)}, "batch_size": 8},
                 "optimizer": {"name": "sgd", "lr": 0.05}, "stop": {"max_steps": 1_000_000}, "eval_every": 0})
    job = ElasticJob(config_from_dict(cfg)).start()
    try:
        assert ray.cluster_resources()["CPU"] == 4, "room for workers.max (3) and the spare"
        job.wait_for(step=5)
        assert [s["state"] for s in job.status().spares] == ["starting"], "the spare is held at its start"
        answer: dict = {}
        scaling = threading.Thread(target=lambda: answer.update(status=job.scale(3)))
        scaling.start()
        w2 = wait_until(lambda: (m := member(job, "w2")) and "waiting for a hot spare" in m.cause and m, 60,
                        "w2 to wait for the spare")
        assert w2.state == "starting" and scaling.is_alive(), "scale() returns once w2 has joined"
        gate.touch()
        scaling.join(60)
        assert answer["status"].world_size == 3, answer
        join = job.wait_for(joins_w2)
        taken = next(e for e in job.events() if e["reason"].startswith("w2 is hot spare spare1"))
        after_ready = join["detail"]["first_step_at"] - taken["detail"]["ready_at"]
        print(f"scale(3) before the spare was ready: w2's first committed step {after_ready:.3f}s after the spare was ready")
        assert after_ready < JOIN_BOUND_S, after_ready
        assert not [e["reason"] for e in job.events() if e["kind"] == "unplaced"]

        figures, returns = [], []
        for _ in range(10):
            seen = len(job.events())
            job.scale(2)
            job.wait_for(lambda e: e["kind"] == "reshape" and e["detail"]["leavers"] == ["w2"], since=seen)
            wait_until(lambda: member(job, "w2").state == "left", 60, "w2 to leave")
            wait_until(lambda: any(s["state"] == "ready" for s in job.status().spares), 120, "a ready spare")
            seen = len(job.events())
            asked = time.time()
            job.scale(3)
            returns.append(time.time() - asked)
            figures.append(job.wait_for(joins_w2, since=seen)["detail"]["first_step_at"] - asked)
        print("scale(3) with a ready spare -> first committed step at world size 3 (s): "
              + " ".join(f"{f:.3f}" for f in figures) + "; scale() returned after (s): "
              + " ".join(f"{r:.3f}" for r in returns))
        assert max(figures) < JOIN_BOUND_S, figures
    finally:
        try:
            job.stop()
        finally:
            ray.shutdown()  # the next test starts the suite's shared Ray again
