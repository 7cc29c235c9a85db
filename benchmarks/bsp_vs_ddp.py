"""BSP through the orchestrator vs plain torch DDP (gloo), and start-up vs Ray Train, side by side.

Same workload on both sides, built by the same factory and trained with its own loss: `--workload
digits` (the default) the digits MLP (hidden 128), per-worker batch 32, SGD (lr 0.05, momentum 0.9);
`--workload lm` the byte-level GPT (`orchestrator.workloads.lm:gpt`, tiny: 0.83M parameters, 64-byte
context), per-worker batch 8, AdamW (lr 0.003, betas 0.9/0.95, weight decay 0.01). 2 workers, 25 MiB
buckets, one torch thread per worker, the same imports and the same global-batch sampler; DDP's side
uses torch's own optimizer (`foreach=False`) and gathers its rows as a user writes it (`t[ids]`). Ray
starts its workers at niceness 15 (so that its own processes stay responsive) and torchrun starts DDP's
at 0: on a machine whose cores are all busy that alone slows the orchestrator's side; `--ddp-niceness
ray` runs DDP's ranks at Ray's niceness too.
Throughput is timed on rank 0 with the same timer (`time.time()` after each optimizer step) over
steps 50..550, in alternating pairs (orchestrator, DDP, ...); the ratio is taken pair by pair and its
median reported. Peak RSS: the largest worker process of each side, both sampled the same way (psutil,
every 0.1 s while they train). Start-up: from `ElasticJob.start()` to the first committed step, next
to Ray Train's `TorchTrainer.fit()` to its first completed step, on the same workload and Ray. The two
sides are `testkit/ddp_pair.py` (the slow tier's speed gate runs them too); this script pairs them and
adds Ray Train's start-up.

    python benchmarks/bsp_vs_ddp.py [--pairs 5] [--steps 550] [--startup-runs 3] [--workload digits|lm]
        [--set workers.huge_pages=false ...]
        [--ddp-niceness 0|ray]

Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from algorithms.rules.sampler import GlobalSampler, split_for_rank  # noqa: E402
from testkit.ddp_pair import SEED, WINDOW, WORKERS, WORKLOADS, batch_of, build, log, run_ddp, run_orchestrator  # noqa: E402


# --------------------------------------------------------------------------- Ray Train
def _ray_train_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    workload, make_opt = build(config["workload"])
    model = ray.train.torch.prepare_model(workload.model)
    opt = make_opt(model.parameters())
    data = workload.train_data
    rank = ray.train.get_context().get_world_rank()
    sampler = GlobalSampler(len(data), SEED)
    global_batch = WORKERS * WORKLOADS[config["workload"]]["per_worker"]
    for step in range(1, config["steps"] + 1):
        ids = torch.from_numpy(split_for_rank(sampler.global_batch((step - 1) * global_batch, global_batch), rank, WORKERS))
        opt.zero_grad()
        workload.loss(model, batch_of(data, ids)).backward()
        opt.step()
        if step == 1 and rank == 0:
            Path(config["mark"]).write_text(repr(time.time()))


def run_ray_train(storage: str, workload: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    mark = Path(tempfile.mkdtemp()) / "first_step"
    trainer = TorchTrainer(_ray_train_loop, train_loop_config={"steps": 20, "mark": str(mark), "workload": workload},
                           scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(storage_path=storage, name=f"bench-{time.time_ns()}"))
    before = time.time()
    trainer.fit()
    return float(mark.read_text()) - before


# --------------------------------------------------------------------------- main
def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=550)
    parser.add_argument("--startup-runs", type=int, default=3)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="digits")
    parser.add_argument("--ddp-niceness", choices=["0", "ray"], default="0",
                        help="DDP's ranks at niceness 0 (as torchrun starts them), or at the niceness Ray gives its "
                             "workers (15 by default), so that both sides yield alike to Ray's own processes")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the orchestrator's job (repeatable), e.g. workers.huge_pages=false")
    args = parser.parse_args()
    window = WINDOW if args.steps >= WINDOW[1] else (min(50, args.steps // 3), args.steps)  # a short trial run times what it has

    import ray

    from orchestrator.job import NAMESPACE, ensure_token_env

    os.environ.setdefault("ORCHESTRATOR_RUN_ROOT", tempfile.mkdtemp(prefix="bench-runs-"))
    ensure_token_env()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")

    niceness = 0
    if args.ddp_niceness == "ray":
        niceness = ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote())
        log(f"Ray's workers run at niceness {niceness}: DDP's ranks too")
    pairs = []
    for i in range(args.pairs):
        orch = run_orchestrator(f"bench-bsp-{i}", args.steps, args.workload, args.set, window)
        ddp = run_ddp(args.steps, args.workload, niceness, window)
        pairs.append({"orch": orch, "ddp": ddp, "ratio": orch["steps_per_s"] / ddp["steps_per_s"],
                      "rss_ratio": orch["rss_mib"] / ddp["rss_mib"]})
        log(f"pair {i + 1}/{args.pairs}: orchestrator {orch['steps_per_s']:.1f} steps/s, DDP {ddp['steps_per_s']:.1f} "
            f"steps/s, ratio {pairs[-1]['ratio']:.3f}; RSS {orch['rss_mib']:.0f} vs {ddp['rss_mib']:.0f} MiB")

    startup_orch = [p["orch"]["startup_s"] for p in pairs][: max(args.startup_runs, 1)]
    startup_rt, rt_error = [], None
    storage = tempfile.mkdtemp(prefix="bench-raytrain-")
    for i in range(args.startup_runs):
        try:
            startup_rt.append(run_ray_train(storage, args.workload))
            log(f"Ray Train start-up {i + 1}/{args.startup_runs}: {startup_rt[-1]:.2f}s")
        except Exception as err:  # noqa: BLE001 - report it rather than crash the table
            rt_error = f"{type(err).__name__}: {err}"
            log(f"Ray Train failed: {rt_error}")
            break
    ray.shutdown()

    ratio = summarize([p["ratio"] for p in pairs])
    rss_ratio = summarize([p["rss_ratio"] for p in pairs])
    so, sr = summarize(startup_orch), summarize(startup_rt)
    startup_ratio = so["median"] / sr["median"] if so and sr else None
    rows = [
        ("steps/s, orchestrator BSP", summarize([p["orch"]["steps_per_s"] for p in pairs])),
        ("steps/s, torch DDP (gloo)", summarize([p["ddp"]["steps_per_s"] for p in pairs])),
        ("steps/s ratio orchestrator / DDP", ratio),
        ("peak worker RSS MiB, orchestrator", summarize([p["orch"]["rss_mib"] for p in pairs])),
        ("peak worker RSS MiB, DDP", summarize([p["ddp"]["rss_mib"] for p in pairs])),
        ("RSS ratio orchestrator / DDP", rss_ratio),
        ("start-up s, start() -> first step", so),
        ("start-up s, Ray Train fit() -> first step", sr),
    ]
    print(f"{'metric (median [min-max])':<44}{'value':>24}")
    for label, s in rows:
        value = f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]" if s else "n/a"
        print(f"{label:<44}{value:>24}")
    print(f"{'start-up ratio orchestrator / Ray Train':<44}{(f'{startup_ratio:.3f}' if startup_ratio else 'n/a'):>24}")
    print(json.dumps({"benchmark": "bsp_vs_ddp", "workload": args.workload, "ddp_niceness": niceness,
                      "pairs": args.pairs, "window": list(window), "workers": WORKERS, "overrides": args.set,
                      "steps_per_s_ratio_median": ratio["median"], "rss_ratio_median": rss_ratio["median"],
                      "startup_ratio_vs_ray_train": startup_ratio, "startup_orchestrator_s": so, "startup_ray_train_s": sr,
                      "ray_train_error": rt_error, "per_pair": pairs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
