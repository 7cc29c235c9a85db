"""Per-step time of gossip (`dpsgd` on a ring, `dadam` on the one-peer exponential graph) against
synchronous all-reduce (`bsp`) at 4 workers when one worker's compute jitters.

Every policy trains digits (configs/digits_bsp.yaml, digits_dpsgd.yaml, digits_dadam.yaml) with
4 workers for `--steps` steps. The compute is modelled, since one 2-core machine has no accelerators:
every slot sleeps `--compute-ms` a step (`faults.stragglers` with `delay_s`), and on slot `--slot`
that step time is multiplied by a seeded lognormal factor of median 1 (`jitter: {dist: lognormal,
sigma, seed}`), the same factors on every run. BSP waits for the slowest member at every step; a
gossip member waits only for its topology's peers of that step, and its neighbours may run ahead
of the jittering worker by as many steps as they are hops away from it.

Figures per policy, from one run each (each a median over all of its per-step figures):
- step interval: the time between consecutive history records of one member (bsp: rank 0's
  records, one per committed step), the median over every member's intervals;
- job time per step: wall time from the job's first record to its last, over the steps
  (bsp: committed steps; gossip: the slowest member's steps, the job's step);
- wait: the median of each step's `wait_s` (time the step waited on others).
The gossip runs set `sync.consensus_every` to `--consensus-every` (0 by default: the consensus
measurement is a global all-reduce, which would make every member wait for the slowest now and then).

    python benchmarks/gossip.py [--steps 300] [--compute-ms 20] [--sigma 1.0] [--seed 0] [--slot w3]

Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import ray  # noqa: E402

from orchestrator.config import config_from_dict, load_config  # noqa: E402
from orchestrator.job import NAMESPACE, ElasticJob  # noqa: E402

CONFIGS = {"bsp": "digits_bsp", "dpsgd": "digits_dpsgd", "dadam": "digits_dadam"}


def run(policy: str, args: argparse.Namespace, root: str) -> dict:
    over = [f"workers.count={args.workers}", "workers.min=1", "workers.cpus=0.5", "eval_every=0", f"run_dir={root}",
            f"name=gossip-bench-{policy}", f"stop.max_steps={args.steps}", "stop.target=null"]
    if policy != "bsp":
        over.append(f"sync.consensus_every={args.consensus_every}")
    cfg = load_config(REPO / "configs" / f"{CONFIGS[policy]}.yaml", over).to_dict()
    jitter = {"dist": "lognormal", "sigma": args.sigma, "seed": args.seed}
    cfg["faults"]["stragglers"] = [dict({"slot": f"w{i}", "delay_s": args.compute_ms / 1000},
                                        **({"jitter": jitter} if f"w{i}" == args.slot else {}))
                                   for i in range(args.workers)]
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=1800)
    history = job.history()
    if result.state != "FINISHED" or not history:
        raise RuntimeError(f"{policy}: {result.state} ({result.cause})")
    times = defaultdict(list)
    for record in history:
        times[record.get("slot", "rank0")].append(record["time"])
    intervals = [b - a for ts in times.values() for a, b in zip(sorted(ts), sorted(ts)[1:])]
    span = max(r["time"] for r in history) - min(r["time"] for r in history)
    steps = result.step - min(r["step"] for r in history)
    return {"step_interval_ms": 1000 * statistics.median(intervals), "job_ms_per_step": 1000 * span / max(steps, 1),
            "wait_ms": 1000 * statistics.median(r.get("wait_s", 0.0) for r in history),
            "accuracy": result.metrics.get("accuracy"), "steps": result.step, "seconds": result.elapsed_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--compute-ms", type=float, default=20.0, help="modelled compute per step, every slot")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the jittering slot's factor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slot", default="w3", help="the slot whose compute jitters")
    parser.add_argument("--consensus-every", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=["bsp", "dpsgd", "dadam"])
    args = parser.parse_args()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for policy in args.policies:
            results[policy] = run(policy, args, root)
            print(f"{policy}: {results[policy]}", flush=True)
    print()
    print(f"{args.workers} workers, compute {args.compute_ms:g} ms a step on every slot, {args.slot}'s step time x "
          f"lognormal(sigma {args.sigma:g}, seed {args.seed}), {args.steps} steps, one run each, medians")
    print(f"{'policy':7s} {'step interval ms':>17s} {'job ms/step':>12s} {'wait ms':>8s} {'vs bsp':>7s} {'accuracy':>9s}")
    base = results.get("bsp", {}).get("job_ms_per_step")
    for policy, r in results.items():
        ratio = f"{r['job_ms_per_step'] / base:.2f}x" if base else "-"
        print(f"{policy:7s} {r['step_interval_ms']:17.1f} {r['job_ms_per_step']:12.1f} {r['wait_ms']:8.1f} {ratio:>7s} "
              f"{r['accuracy'] if r['accuracy'] is not None else float('nan'):9.4f}")
    print(json.dumps({"benchmark": "gossip", "workers": args.workers, "steps": args.steps, "compute_ms": args.compute_ms,
                      "sigma": args.sigma, "seed": args.seed, "slot": args.slot, "consensus_every": args.consensus_every,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
