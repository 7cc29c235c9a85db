"""The chaos run (slow: `pytest --run-slow tests/e2e/test_chaos.py`): a 450-step BSP run on digits
with 6 worker deaths (inside an all-reduce, at a checkpoint, while joining, a user exception, two
external SIGKILLs), replacements joining and a scale-down, against a fault-free run."""
from __future__ import annotations

import io
import os
import signal
import time

import pytest
import torch

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob

STEPS = 450


def config(name: str, kills: list) -> dict:
    return {"name": name, "seed": 9,
            "workers": {"count": 4, "min": 2, "max": 4, "cpus": 0.5, "failure_budget": 10},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 64}, "batch_size": 8},
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "checkpoint": {"every_steps": 50},
            "stop": {"max_steps": STEPS}, "eval_every": 0,
            "faults": {"kills": kills, "stragglers": [{"slot": "w3", "delay_s": 0.05}]}}


def params(job: ElasticJob) -> list[torch.Tensor]:
    return list(torch.load(io.BytesIO((job.run_dir / "model.pt").read_bytes()), weights_only=True)["model"].values())


def wait_for_step(job: ElasticJob, step: int) -> None:
    deadline = time.monotonic() + 240
    while job.status().step < step:
        assert time.monotonic() < deadline, f"no progress to step {step}"
        time.sleep(0.05)


def wait_for_full_membership(job: ElasticJob, world: int = 4) -> None:
    """Every action waits for the state it needs: replacements can take 10 s or more to start."""
    deadline = time.monotonic() + 240
    while not ((s := job.status()).state == "RUNNING" and s.world_size == world):
        assert time.monotonic() < deadline and s.state not in ("FINISHED", "FAILED"), f"never back to {world}: {s.state}"
        time.sleep(0.05)


@pytest.mark.slow
def test_chaos_run_finishes_with_nothing_lost(run_root):
    clean = ElasticJob(config_from_dict(config("chaos-clean", []))).start()
    assert clean.wait(timeout=600).state == "FINISHED"
    kills = [{"slot": "w1", "step": 40, "at": "allreduce"},
             {"slot": "w2", "step": 100, "at": "checkpoint"},
             {"slot": "w1", "step": 41, "at": "join"},
             {"slot": "w0", "step": 180, "at": "user_exception"}]
    job = ElasticJob(config_from_dict(config("chaos", kills))).start()
    for step, slot in ((260, "w2"), (320, "w0")):
        wait_for_step(job, step)
        wait_for_full_membership(job)
        os.kill(next(m.pid for m in job.status().members if m.slot == slot), signal.SIGKILL)
    wait_for_step(job, 380)
    wait_for_full_membership(job)
    job.scale(3)
    result = job.wait(timeout=600)
    assert result.state == "FINISHED" and result.step == STEPS
    events = job.events()
    deaths = [e for e in events if e["kind"] == "failure"]
    reshapes = [e for e in events if e["kind"] == "reshape"]
    joins = [e for e in reshapes if e["detail"]["joiners"]]
    downs = [e for e in reshapes if e["detail"]["leavers"]]
    history = job.history()
    diff = max(float((a - b).abs().max()) for a, b in zip(params(job), params(clean)))
    recoveries = sorted(e["detail"]["duration_s"] for e in reshapes if e["detail"]["detector"] in ("actor death", "task error"))
    print(f"chaos: {len(deaths)} deaths ({', '.join(sorted({e['detail']['detector'] for e in deaths}))}), "
          f"{len(joins)} joins, {len(downs)} scale-down; {len(history)} steps; max abs diff vs fault-free {diff:.2e}; "
          f"death -> next committed step: median {recoveries[len(recoveries) // 2]:.3f}s, max {recoveries[-1]:.3f}s")
    assert len(deaths) >= 6 and len(joins) >= 2 and len(downs) == 1
    assert {e["detail"]["phase"] for e in events if e["kind"] == "fault"} == {"allreduce", "checkpoint", "join", "user_exception"}
    assert [r["step"] for r in history] == list(range(1, STEPS + 1)), "a committed step was lost or repeated"
    assert diff < 6e-6  # the README states 5.96e-07
