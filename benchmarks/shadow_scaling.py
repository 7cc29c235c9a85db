"""Throughput scaling of background ("shadow") synchronization against synchronous all-reduce (`bsp`).

Both sides train the CTR workload (orchestrator/workloads/ctr.py: embedding tables and dense layers on
synthetic click logs with a known best AUC) at 1, 2 and 4 workers, `workers.batch_mode: keep_worker`
(each worker's batch stays `--batch`), for `--steps` steps per worker. Two things are modelled, since
one 2-core machine has neither real accelerators nor a real network:
- compute: every step sleeps `--compute-ms` on top of its real compute (`faults.stragglers` with
  `delay_s` on every slot), so that 4 workers are not capped by 2 cores;
- the network: every collective completes no sooner than `--latency-ms` after its launch
  (`faults.comm_latency_s`), as a slow network would add. BSP waits for it every step; shadow's
  background rounds absorb it.

Figures per run: throughput = samples trained / wall time (first to last history record of the job),
each worker's peak RSS (the largest worker process), the foreground's blocked-time fraction (time a step waited on others, for its samples,
the policy's lock or its collectives, over the steps' wall time; from history's `wait_s`), the final model's held-out
log loss and AUC (shadow: the average of the replicas; bsp: the committed model), and the number of
background rounds (shadow). Scaling efficiency at n workers = throughput(n) / (n x throughput(1)) of the
same policy. Median of `--repeats` runs per point.

    python benchmarks/shadow_scaling.py [--workers 1 2 4] [--steps 300] [--compute-ms 50] [--latency-ms 30] [--repeats 1]

Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import ray  # noqa: E402

from orchestrator.config import config_from_dict, load_config  # noqa: E402
from orchestrator.job import NAMESPACE, ElasticJob  # noqa: E402
from testkit.peers import PeakRSS  # noqa: E402


def run(policy: str, n: int, args: argparse.Namespace, seed: int, root: str) -> dict:
    config = load_config(REPO / "configs" / f"ctr_{policy}.yaml", [
        f"seed={seed}", f"workers.count={n}", "workers.min=1", "workers.cpus=0.5", "workers.batch_mode=keep_worker",
        f"workload.batch_size={args.batch}", f"workload.params.samples={args.samples}", "eval_every=0",
        f"run_dir={root}", f"name=shadow-scaling-{policy}-{n}-{seed}", f"stop.max_steps={args.steps}", "stop.target=null"])
    cfg = config.to_dict()
    cfg["faults"]["stragglers"] = [{"slot": f"w{i}", "delay_s": args.compute_ms / 1000} for i in range(n)]
    cfg["faults"]["comm_latency_s"] = args.latency_ms / 1000
    job = ElasticJob(config_from_dict(cfg)).start()
    peak = PeakRSS.of_job(job)
    result = job.wait(timeout=1800)
    rss_mib = peak.stop()
    history = job.history()
    if result.state != "FINISHED" or not history:
        raise RuntimeError(f"{policy} at {n}: {result.state} ({result.cause})")
    span = max(r["time"] for r in history) - min(r["time"] - r["step_time"] for r in history)
    if policy == "bsp":
        samples = sum(r["global_batch"] for r in history)
    else:
        samples = sum(r["samples"] for r in history)
    waited = sum(r.get("wait_s", 0.0) for r in history)
    stepped = sum(r["step_time"] for r in history)
    status = job.status()
    metrics = dict(status.metrics)
    return {"throughput": samples / span, "seconds": span, "samples": samples, "blocked": waited / stepped, "rss_mib": rss_mib,
            "auc": metrics.get("auc"), "log_loss": metrics.get("log_loss"), "rounds": _rounds(history) if policy == "shadow" else None}


def _rounds(history: list[dict]) -> int:
    """Background rounds completed, summed over the members (each member's newest record's count)."""
    newest: dict[str, int] = {}
    for record in history:
        newest[record["slot"]] = max(newest.get(record["slot"], 0), record.get("rounds", 0))
    return sum(newest.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=300, help="steps per worker")
    parser.add_argument("--batch", type=int, default=64, help="samples per worker and step")
    parser.add_argument("--samples", type=int, default=200_000, help="click logs generated (80%% train)")
    parser.add_argument("--compute-ms", type=float, default=50.0, help="modelled compute per step")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="modelled latency of every collective")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--policies", nargs="+", default=["bsp", "shadow"])
    args = parser.parse_args()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    results: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory() as root:
        for n in args.workers:
            for policy in args.policies:
                runs = [run(policy, n, args, seed, root) for seed in range(args.repeats)]
                point = {k: statistics.median(r[k] for r in runs) if runs[0][k] is not None else None for k in runs[0]}
                results.setdefault(policy, {})[n] = point
                print(f"{policy:6s} n={n}: {point['throughput']:8.1f} samples/s, blocked {point['blocked']:.3f}, "
                      f"auc {point['auc']}, log loss {point['log_loss']}", flush=True)
    print()
    print(f"compute {args.compute_ms:g} ms a step (sleep), latency {args.latency_ms:g} ms a collective, batch {args.batch} "
          f"a worker, {args.steps} steps a worker, median of {args.repeats}")
    print(f"{'policy':8s} {'n':>2s} {'samples/s':>10s} {'efficiency':>10s} {'blocked':>8s} {'AUC':>7s} {'log loss':>9s} "
          f"{'rounds':>7s} {'RSS MiB':>8s}")
    for policy, points in results.items():
        base = points.get(1, {}).get("throughput")
        for n, p in points.items():
            p["efficiency"] = p["throughput"] / (n * base) if base else None
            eff = f"{p['efficiency']:.3f}" if p["efficiency"] is not None else "-"
            print(f"{policy:8s} {n:2d} {p['throughput']:10.1f} {eff:>10s} {p['blocked']:8.3f} {p['auc'] or 0:7.4f} "
                  f"{p['log_loss'] or 0:9.4f} {p['rounds'] if p['rounds'] is not None else '-':>7} {p['rss_mib']:8.1f}")
    top = max(args.workers)
    if "bsp" in results and "shadow" in results and top in results["bsp"]:
        s, b = results["shadow"][top], results["bsp"][top]
        print(f"at {top} workers: shadow/bsp throughput {s['throughput'] / b['throughput']:.2f}x, "
              f"AUC difference {(s['auc'] or 0) - (b['auc'] or 0):+.4f}")
    print(json.dumps({"benchmark": "shadow_scaling", "compute_ms": args.compute_ms, "latency_ms": args.latency_ms,
                      "batch": args.batch, "steps": args.steps, "repeats": args.repeats,
                      "results": {p: {str(n): v for n, v in pts.items()} for p, pts in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
