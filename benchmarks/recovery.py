"""Recovery from a worker death, side by side with Ray Train, and the cost of a live join.

(a) A worker of a running job is SIGKILLed (the killer takes the timestamp); the victims rotate
    over every rank, rank 0 included (the state source at the next epoch start and the member
    that reports history). Orchestrator: time to the survivors' next committed step, and the
    committed steps lost (redone), from history. Ray Train
    (`TorchTrainer`, `FailureConfig(max_failures=...)`): the same kill of a training worker's
    process, time to the next completed step after Ray Train restarts the group from its latest
    checkpoint, and the steps it redoes. Same workload (digits MLP), same world size, same
    checkpoint interval, in the same Ray, medians over `--events` kills each. `--workload digits`
    (the default): the digits MLP (hidden 64), per-worker batch 16, SGD lr 0.05; `--workload lm`: the
    byte-level GPT (`orchestrator.workloads.lm:gpt`, tiny: 0.83M parameters), per-worker batch 8,
    AdamW lr 0.003 (its state, parameters and optimizer, is what a replacement receives).
(b) `scale()` to the joiner's first committed step, and the survivors' longest step during the join.
With `--spares k` the job keeps k hot spares (`workers.spares`): each replacement after a kill and
the join take a spare, and (a) also reports death -> the replacement's first committed step.

    python benchmarks/recovery.py [--events 5] [--workers 3] [--checkpoint-every 50] [--spares 0]
        [--workload digits|lm] [--set workers.huge_pages=false ...]

Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from algorithms.rules.sampler import GlobalSampler, split_for_rank  # noqa: E402
from benchmarks.common import peer_workload  # noqa: E402
from testkit.harness import wait_until  # noqa: E402

SEED = 0
WORKLOADS = {
    "digits": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 64}, "per_worker": 16,
               "optimizer": {"name": "sgd", "lr": 0.05}},
    "lm": {"factory": "orchestrator.workloads.lm:gpt", "params": {"size": "tiny"}, "per_worker": 8,
           "optimizer": {"name": "adamw", "lr": 0.003}},
}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- orchestrator
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


# --------------------------------------------------------------------------- Ray Train
def _ray_train_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    torch.set_num_threads(1)
    w = WORKLOADS[config["workload"]]
    workload, make_opt = peer_workload(w, SEED)
    model = ray.train.torch.prepare_model(workload.model)
    opt = make_opt(model.parameters())
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    start = 0
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt", weights_only=True)
        model.module.load_state_dict(state["model"]) if hasattr(model, "module") else model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    marks = Path(config["marks"])
    Path(marks, f"pid-{rank}-{os.getpid()}").write_text(str(time.time()))
    tensors = workload.train_data.tensors
    sampler = GlobalSampler(len(tensors[0]), SEED)
    global_batch = world * w["per_worker"]
    for step in range(start + 1, config["steps"] + 1):
        ids = torch.from_numpy(split_for_rank(sampler.global_batch((step - 1) * global_batch, global_batch), rank, world))
        opt.zero_grad()
        workload.loss(model, tuple(t[ids] for t in tensors)).backward()
        opt.step()
        if rank == 0:
            with open(marks / "steps.txt", "a") as fh:
                fh.write(f"{step} {time.time()}\n")
        if step % config["every"] == 0:
            with tempfile.TemporaryDirectory() as folder:
                if rank == 0:
                    inner = model.module if hasattr(model, "module") else model
                    torch.save({"model": inner.state_dict(), "optimizer": opt.state_dict(), "step": step},
                               Path(folder) / "state.pt")
                ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(folder) if rank == 0 else None)


def ray_train_side(events: int, workers: int, every: int, workload: str = "digits") -> dict:
    import threading

    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    marks = Path(tempfile.mkdtemp(prefix="rt-marks-"))
    storage = Path(tempfile.mkdtemp(prefix="rt-store-"))
    trainer = TorchTrainer(
        _ray_train_loop, train_loop_config={"steps": 10_000_000, "every": every, "marks": str(marks), "workload": workload},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(storage), name=f"recovery-{time.time_ns()}",
                             failure_config=FailureConfig(max_failures=events + 2),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    runner = threading.Thread(target=lambda: _fit_quietly(trainer), daemon=True)
    runner.start()

    def steps() -> list[tuple[int, float]]:
        path = marks / "steps.txt"
        if not path.exists():
            return []
        return [(int(a), float(b)) for a, b in (line.split() for line in path.read_text().splitlines() if line.strip())]

    # Kill mid-interval, two checkpoints after (re)starting, so that one has surely been registered.
    settle = 2 * every + every // 2
    wait_until(lambda: len(steps()) > settle and any(storage.rglob("checkpoint_*")), 300, "Ray Train's checkpoints")
    delays, lost, ranks = [], [], []
    for i in range(events):
        pids = {}
        for p in marks.glob("pid-*"):
            _, rank, pid = p.name.split("-")
            pids[int(rank)] = int(pid)  # the newest incarnation of each rank overwrites older ones
        rank = i % workers
        victim = pids[rank]
        for p in marks.glob("pid-*"):
            p.unlink()  # the restarted group writes its own
        before = steps()[-1][0]
        killed_at = time.time()
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
        after = wait_until(lambda: next(((s, t) for s, t in steps() if t > killed_at + 0.05 and s <= before + 1), None)
                           or next(((s, t) for s, t in steps() if t > killed_at + 30), None), 300, "Ray Train to recover")
        delays.append(after[1] - killed_at)
        lost.append(before - (after[0] - 1))
        ranks.append(rank)
        log(f"Ray Train kill {i + 1}/{events} (rank {rank}): next step {after[0]} after {delays[-1]:.2f}s, "
            f"redoing {lost[-1]} steps")
        wait_until(lambda: len(list(marks.glob("pid-*"))) >= workers and steps()[-1][0] > after[0] + settle, 300, "steady")
    return {"death_to_next_step_s": delays, "steps_lost": lost, "victim_ranks": ranks}


def _fit_quietly(trainer) -> None:
    try:
        trainer.fit()
    except Exception as err:  # noqa: BLE001 - the benchmark ends the run by shutting Ray down
        log(f"Ray Train ended: {type(err).__name__}")


# --------------------------------------------------------------------------- main
def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}] ({len(values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=5)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--spares", type=int, default=0, help="hot spares the orchestrator's job keeps")
    parser.add_argument("--no-ray-train", action="store_true", help="the orchestrator's side only")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="digits")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the orchestrator's job (repeatable), e.g. workers.huge_pages=false")
    args = parser.parse_args()

    import ray

    from orchestrator.job import NAMESPACE, ensure_token_env

    os.environ.setdefault("ORCHESTRATOR_RUN_ROOT", tempfile.mkdtemp(prefix="bench-runs-"))
    ensure_token_env()
    # Each side runs `workers` one-CPU workers and the orchestrator's join one more; Ray Train's
    # controller and the coordinator need room too.
    ray.init(address="local", num_cpus=max(8, args.workers + args.spares + 3), namespace=NAMESPACE, log_to_driver=False,
             logging_level="ERROR")
    orch = orchestrator_side(args.events, args.workers, args.checkpoint_every, args.spares, args.workload,
                             tuple(args.set))
    rt, rt_error = None, "not run (--no-ray-train)"
    if not args.no_ray_train:
        try:
            rt, rt_error = ray_train_side(args.events, args.workers, args.checkpoint_every, args.workload), None
        except Exception as err:  # noqa: BLE001 - report it rather than crash the table
            rt, rt_error = None, f"{type(err).__name__}: {err}"
            log(f"Ray Train side failed: {rt_error}")

    o_med = statistics.median(orch["death_to_next_step_s"])
    r_med = statistics.median(rt["death_to_next_step_s"]) if rt else None
    rows = [
        ("death -> next committed step, orchestrator (s)",
         f"{o_med:.3f} [{min(orch['death_to_next_step_s']):.3f}-{max(orch['death_to_next_step_s']):.3f}]"),
        ("death -> next step, Ray Train (s)",
         f"{r_med:.2f} [{min(rt['death_to_next_step_s']):.2f}-{max(rt['death_to_next_step_s']):.2f}]" if rt else "n/a"),
        ("speed-up (Ray Train / orchestrator)", f"{r_med / o_med:.1f}x" if rt else "n/a"),
        *((f"  {name} (s)", _spread([p[name] for p in orch["phases_s"] if p[name] is not None])) for name in PHASES),
        ("killed ranks, orchestrator", str(orch["victim_ranks"])),
        ("committed steps lost per death, orchestrator", str(orch["steps_lost"])),
        (f"death -> replacement's first step, {args.spares} spares (s)",
         f"{statistics.median(orch['death_to_replacement_step_s']):.3f} [{min(orch['death_to_replacement_step_s']):.3f}-"
         f"{max(orch['death_to_replacement_step_s']):.3f}]"),
        ("killed ranks, Ray Train", str(rt["victim_ranks"]) if rt else "n/a"),
        ("steps redone per death, Ray Train", str(rt["steps_lost"]) if rt else "n/a"),
        (f"scale() -> joiner's first committed step, {args.spares} spares (s)", f"{orch['scale_to_first_step_s']:.3f}"),
        ("scale() -> the coordinator hears of it (s)", f"{orch['scale_to_join_event_s']:.3f}"),
        ("survivors' longest step during the join (s)", f"{orch['longest_step_during_join_s']:.3f}"),
    ]
    print(f"{'metric (median [min-max])':<48}{'value':>28}")
    for label, value in rows:
        print(f"{label:<48}{value:>28}")
    print(json.dumps({"benchmark": "recovery", "workload": args.workload, "events": args.events, "workers": args.workers,
                      "overrides": args.set,
                      "checkpoint_every": args.checkpoint_every, "orchestrator": orch, "ray_train": rt,
                      "ray_train_error": rt_error, "speedup_median": (r_med / o_med) if rt else None}), flush=True)
    # Shut Ray down only once the results are out: Ray Train's fit() thread still calls into Ray, and a
    # call after the shutdown makes Ray's core worker end the whole process (the table was lost so).
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
