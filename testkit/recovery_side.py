"""The orchestrator's side of the recovery benchmark (`benchmarks/recovery.py`, and the slow tier's speed gate
`tests/e2e/test_speed.py`): a job whose workers are SIGKILLed one after another, rotating over every rank
(rank 0 included: the state source at the next epoch start and the member that reports history), timed to the
survivors' next committed step, with the committed steps lost, each recovery by phase on the job's own
timeline, the replacement's first step, then `scale()` to a joiner's first committed step.

`digits` is the digits MLP (hidden 64), per-worker batch 16, SGD lr 0.05; `lm` the byte-level GPT
(`orchestrator.workloads.lm:gpt`, tiny), per-worker batch 8, AdamW lr 0.003 (its state, parameters and
optimizer, is what a replacement receives). The job runs on the Ray this process is connected to.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from testkit.job_checks import wait_until

SEED = 0
WORKLOADS = {
    "digits": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 64}, "per_worker": 16,
               "optimizer": {"name": "sgd", "lr": 0.05}},
    "lm": {"factory": "orchestrator.workloads.lm:gpt", "params": {"size": "tiny"}, "per_worker": 8,
           "optimizer": {"name": "adamw", "lr": 0.003}},
}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def orchestrator_side(events: int, workers: int, every: int, spares: int = 0, workload: str = "digits",
                      overrides: tuple[str, ...] = ()) -> dict:
    from orchestrator.config import config_from_dict
    from orchestrator.job import ElasticJob

    cfg = config_from_dict({
        "name": "bench-recovery", "seed": SEED, "workers": {"count": workers, "max": workers + 1, "cpus": 1,
                                              "failure_budget": 100,  # kills rotate over the slots: none retires
                                              "spares": spares},
        "workload": {"factory": WORKLOADS[workload]["factory"], "params": WORKLOADS[workload]["params"],
                     "batch_size": WORKLOADS[workload]["per_worker"]},
        "optimizer": WORKLOADS[workload]["optimizer"], "checkpoint": {"every_steps": every},
        "stop": {"max_steps": 10_000_000}, "eval_every": 0,
    }, overrides)
    job = ElasticJob(cfg).start()
    wait_until(lambda: job.status().step > 50, 120, "training")
    ready_spares = lambda: len([s for s in job.status().spares if s["state"] == "ready"]) >= spares  # noqa: E731
    wait_until(ready_spares, 120, "ready spares")
    delays, lost, ranks, replaced, phases = [], [], [], [], []
    for i in range(events):
        status = job.status()
        victim = sorted((m for m in status.members if m.state == "training"), key=lambda m: m.rank)[i % workers]
        last = job.history()[-1]
        before, epoch = last["step"], last["membership_epoch"]
        seen = len(job.events())
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        # The survivors' next step is in a newer membership epoch: without the victim, or (a spare
        # adopted before the survivors committed one without it) already with its replacement. Its
        # reshape event carries that step and its record's time. Waited for on the coordinator's feed (a
        # long poll): reading history.jsonl every 50 ms, as this did before 2026-11-28, took 12-25 ms of
        # a core per read here (5000 records), a third of a core beside the recovery it measured.
        reshape = job.wait_for(lambda e: e["kind"] == "reshape" and e["time"] > killed_at
                               and e["detail"].get("membership_epoch", 0) > epoch, 60, since=seen)
        first = {"step": reshape["detail"]["first_committed_step"], "time": reshape["detail"]["first_step_at"]}
        delays.append(first["time"] - killed_at)
        history = job.history()
        if [r["step"] for r in history] != list(range(1, len(history) + 1)):
            raise RuntimeError("history lost or repeated a step")
        lost.append(max(0, before - (first["step"] - 1)))  # committed before the kill, done again after it
        ranks.append(victim.rank)
        phases.append(recovery_phases(job, killed_at, first["time"]))
        log(f"orchestrator kill {i + 1}/{events} (rank {victim.rank}): next committed step {first['step']} after "
            f"{delays[-1]:.3f}s (last step in history before the kill {before}); phases "
            + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in phases[-1].items() if v is not None))
        wait_until(lambda: job.status().world_size == workers and job.status().state == "RUNNING", 120, "replacement")
        back = wait_until(lambda: next((e for e in job.events() if e["kind"] == "reshape" and e["time"] > killed_at
                                        and e["detail"]["detector"] == "replacement"), None), 60, "replacement's step")
        replaced.append(back["time"] - killed_at)
        log(f"  the replacement's first committed step {replaced[-1]:.3f}s after the kill")
        wait_until(ready_spares, 120, "ready spares")
    # (b) a join
    wait_until(lambda: job.status().step > job.history()[-1]["step"] - 1, 10, "steady")
    decided = time.time()
    job.scale(workers + 1)
    joined = wait_until(lambda: next((e for e in job.events() if e["kind"] == "reshape"
                                      and e["detail"]["detector"] == "scale request"), None), 120, "join")
    first_step = joined["detail"]["first_committed_step"]  # its record's time is the commit's; the event's is when the
    # coordinator heard of it (reports come every 0.25 s); history may take the record a moment after the event

    def step_times() -> dict[int, float] | None:
        times = {r["step"]: r["time"] for r in job.history()}
        return times if first_step in times else None

    times = wait_until(step_times, 30, "the joiner's first step in history")
    around = [times[s + 1] - times[s] for s in range(first_step - 20, first_step + 20) if s in times and s + 1 in times]
    job.stop()
    return {"death_to_next_step_s": delays, "steps_lost": lost, "victim_ranks": ranks, "spares": spares, "phases_s": phases,
            "death_to_replacement_step_s": replaced, "scale_to_first_step_s": times[first_step] - decided,
            "scale_to_join_event_s": joined["time"] - decided,
            "join_decided_to_first_step_s": joined["detail"]["duration_s"], "longest_step_during_join_s": max(around)}


PHASES = ("kill -> a survivor's failed collective heard", "kill -> death known", "death known -> decided",
          "decided -> next commit")


def recovery_phases(job, killed_at: float, committed_at: float) -> dict[str, float | None]:
    """One recovery on the job's own timeline (seconds). `heard`: the coordinator received a survivor's
    report that its collective failed (absent when Ray's death notice came first); `known`: the death
    was queued as an outcome (a probe's or the member's watch); `decided`: the failure was decided and
    the survivors' plan published; then the survivors' first commit without the victim."""
    def after_kill() -> list[dict] | None:  # the events since the kill, once they hold the failure
        events = [e for e in job.events() if e["time"] > killed_at]
        return events if any(e["kind"] == "failure" for e in events) else None

    events = wait_until(after_kill, 30, "the failure event")
    failed = next(e for e in events if e["kind"] == "failure")
    heard = next((e["time"] for e in events if e["detail"].get("probe")), None)
    known, decided = failed["detail"]["seen_at"], failed["time"]
    return dict(zip(PHASES, (None if heard is None else heard - killed_at, known - killed_at, decided - known,
                             committed_at - decided)))
