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
the join take a spare, and (a) also reports death -> the replacement's first committed step. The
orchestrator's side is `testkit/recovery_side.py` (the slow tier's speed gate runs it too).

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
from testkit.harness import wait_until  # noqa: E402
from testkit.peers import peer_workload  # noqa: E402
from testkit.recovery_side import PHASES, SEED, WORKLOADS, log, orchestrator_side  # noqa: E402


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
