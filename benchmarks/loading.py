"""Background loading against loading on the step (`workload.loader`), side by side in one process.

A workload whose every sample waits `--item-ms` (a read from a disk or a network) and whose step
computes for `--compute-ms` (a modelled compute: a sleep, as a GPU's compute frees the CPU): with batch
8 at 2.5 ms a sample, loading a step's batch costs as long as computing it. One replica (world size 1,
testkit's LocalJob: the worker's own step loop in a thread) runs `--steps` steps with the loader off,
then on (`--workers` threads, `--prefetch` batches ahead), alternating over `--pairs` pairs. Each run's
step time is the median of the gaps between its consecutive history records (after 5 warm-up steps).
Then the language model (tiny, its real compute and its strided-view data) with the loader off and on:
its tokens per second. `--busy`: each sample's loading computes in Python for `--item-ms` (holding the
GIL, as pure-Python decoding does) instead of waiting, and a third run per pair reads with loader
processes (`workload.loader.processes`). `--gpus 1`: the replica on a GPU.

    python benchmarks/loading.py [--pairs 3] [--steps 60] [--item-ms 2.5] [--compute-ms 20] [--workers 2]
        [--prefetch 2] [--skip-lm] [--busy] [--gpus 1] [--lm-size tiny]

Prints a table and one JSON line; figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testkit.harness import LocalJob

WARM_UP = 5


def step_time(config: dict, steps: int, batch: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        job = LocalJob(config, ["w0"], run_dir)
        job.run(("w0",), batch)
        times = [r["time"] for r in sorted(job.link.records, key=lambda r: r["step"])]
    gaps = [b - a for a, b in zip(times[WARM_UP:], times[WARM_UP + 1:])]
    return statistics.median(gaps)


GPUS = 0.0
"""`--gpus`: the replica's GPU share (its batches built ahead are pinned and copied on the loader's stream)."""


def config(workload: dict, steps: int, loader: dict | None) -> dict:
    return {"name": "loading", "seed": 1, "workers": {"count": 1, "cpus": 1, "gpus": GPUS},
            "workload": {**workload, **({"loader": loader} if loader else {})},
            "optimizer": {"lr": 0.01}, "stop": {"max_steps": steps}, "eval_every": 0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--item-ms", type=float, default=2.5)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--skip-lm", action="store_true")
    parser.add_argument("--busy", action="store_true",
                        help="loading computes in Python (holds the GIL) instead of waiting; adds loader processes")
    parser.add_argument("--gpus", type=float, default=0.0, help="run the replica on a GPU (1: the whole GPU)")
    parser.add_argument("--lm-size", default="tiny", help="the language model's size (tiny, small, ...)")
    args = parser.parse_args()
    global GPUS
    GPUS = args.gpus
    batch = 8
    slow = {"factory": "orchestrator.workloads.synthetic:slow_loading", "batch_size": batch,
            "params": {"item_ms": args.item_ms, "compute_ms": args.compute_ms, "busy": args.busy}}
    loader = {"workers": args.workers, "prefetch": args.prefetch}
    off, on, procs = [], [], []
    for _ in range(args.pairs):
        off.append(step_time(config(slow, args.steps, None), args.steps, batch))
        on.append(step_time(config(slow, args.steps, loader), args.steps, batch))
        if args.busy:
            procs.append(step_time(config(slow, args.steps, {**loader, "processes": True}), args.steps, batch))
    loading_s, compute_s = batch * args.item_ms / 1000, args.compute_ms / 1000
    result = {"benchmark": "loading", "gpus": args.gpus, "pairs": args.pairs, "steps": args.steps, "batch": batch,
              "loading_s": loading_s, "compute_s": compute_s, "loader": loader,
              "off_step_s": statistics.median(off), "on_step_s": statistics.median(on),
              "off_runs": off, "on_runs": on}
    result["on_vs_max"] = result["on_step_s"] / max(loading_s, compute_s)
    result["off_vs_sum"] = result["off_step_s"] / (loading_s + compute_s)
    print(f"{'loading a batch':<34}{loading_s * 1000:8.1f} ms")
    print(f"{'computing a step':<34}{compute_s * 1000:8.1f} ms")
    print(f"{'step, loader off (median)':<34}{result['off_step_s'] * 1000:8.1f} ms  "
          f"({result['off_vs_sum']:.2f}x their sum)  runs {', '.join(f'{t * 1000:.1f}' for t in off)}")
    print(f"{'step, loader on (median)':<34}{result['on_step_s'] * 1000:8.1f} ms  "
          f"({result['on_vs_max']:.2f}x the larger)  runs {', '.join(f'{t * 1000:.1f}' for t in on)}")
    if procs:
        result.update(busy=True, processes_step_s=statistics.median(procs), processes_runs=procs)
        result["processes_vs_max"] = result["processes_step_s"] / max(loading_s, compute_s)
        print(f"{'step, loader processes (median)':<34}{result['processes_step_s'] * 1000:8.1f} ms  "
              f"({result['processes_vs_max']:.2f}x the larger)  runs {', '.join(f'{t * 1000:.1f}' for t in procs)}")
    if not args.skip_lm:
        lm = {"factory": "orchestrator.workloads.lm:gpt", "batch_size": batch,
              "params": {"size": args.lm_size}}
        from orchestrator.workloads.lm import gpt

        seq_len = int(gpt(size=args.lm_size).tokens_per_sample)
        lm_off, lm_on = [], []
        for _ in range(args.pairs):
            lm_off.append(batch * seq_len / step_time(config(lm, 40, None), 40, batch))
            lm_on.append(batch * seq_len / step_time(config(lm, 40, loader), 40, batch))
        result["lm_tokens_per_s_off"] = statistics.median(lm_off)
        result["lm_tokens_per_s_on"] = statistics.median(lm_on)
        print(f"{'language model tokens/s, off':<34}{result['lm_tokens_per_s_off']:8.0f}  runs "
              f"{', '.join(f'{t:.0f}' for t in lm_off)}")
        print(f"{'language model tokens/s, on':<34}{result['lm_tokens_per_s_on']:8.0f}  runs "
              f"{', '.join(f'{t:.0f}' for t in lm_on)}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
