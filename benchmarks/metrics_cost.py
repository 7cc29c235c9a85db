"""What exporting metrics costs a job: BSP steps per second with `tracking.metrics` on against off, in
one run, in alternating pairs (on, off, on, off, ...), and the cost of one metric call measured alone.

Same job on both sides: the digits MLP (hidden 128), 2 workers, per-worker batch 32, SGD. Throughput
is rank 0's committed steps per second over steps 50..N, from history's timestamps. The ratio (on
over off) is taken pair by pair and its median reported; the gate in the issue is >= 0.98.

    python benchmarks/metrics_cost.py [--pairs 5] [--steps 1050]

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.config import config_from_dict  # noqa: E402
from orchestrator.job import NAMESPACE, ElasticJob, ensure_token_env  # noqa: E402


def steps_per_s(metrics_on: bool, steps: int, index: int) -> float:
    cfg = {"name": f"metrics-cost-{index}", "seed": 1, "workers": {"count": 2, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 128}, "batch_size": 32},
           "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "stop": {"max_steps": steps}, "eval_every": 0,
           "tracking": {"metrics": metrics_on, "report": False}}
    job = ElasticJob(config_from_dict(cfg)).start()
    assert job.wait(timeout=600).state == "FINISHED"
    history = {r["step"]: r["time"] for r in job.history()}
    return (steps - 50) / (history[steps] - history[50])


@ray.remote(num_cpus=0)
def call_cost(calls: int) -> dict:
    """One metric call's cost in a Ray worker (what a worker pays per report)."""
    from actors.observe.metrics import Exporter

    x = Exporter("cost", "r", "bsp")
    x.observe("worker_step_compute_seconds", 0.01, slot="w0")  # made on first use
    began = time.perf_counter()
    for _ in range(calls):
        x.observe("worker_step_compute_seconds", 0.01, slot="w0")
    observe = (time.perf_counter() - began) / calls
    began = time.perf_counter()
    for _ in range(calls):
        x.inc("committed_steps")
    inc = (time.perf_counter() - began) / calls
    return {"observe_us": observe * 1e6, "inc_us": inc * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1050)
    args = parser.parse_args()
    ensure_token_env()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False,
             logging_level="ERROR")
    on, off = [], []
    for pair in range(args.pairs):
        on.append(steps_per_s(True, args.steps, 2 * pair))
        off.append(steps_per_s(False, args.steps, 2 * pair + 1))
        print(f"pair {pair}: metrics on {on[-1]:.1f} steps/s, off {off[-1]:.1f} steps/s, ratio {on[-1] / off[-1]:.3f}",
              flush=True)
    ratios = [a / b for a, b in zip(on, off)]
    cost = ray.get(call_cost.remote(20000))
    print(f"median steps/s: on {statistics.median(on):.1f}, off {statistics.median(off):.1f}; "
          f"median ratio {statistics.median(ratios):.3f}; one observe {cost['observe_us']:.1f} us, "
          f"one inc {cost['inc_us']:.1f} us")
    print(json.dumps({"benchmark": "metrics_cost", "pairs": args.pairs, "steps": args.steps, "on": on, "off": off,
                      "ratios": ratios, "median_ratio": statistics.median(ratios), **cost}))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
