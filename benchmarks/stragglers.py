"""Time to accuracy with one 3x straggler, for every policy that runs today, next to BSP without one.

Each side is the ready config `configs/digits_<policy>.yaml` (4 workers on scikit-learn's digits,
its own optimizer settings) with: compute modelled by a fixed sleep per step, `--compute-ms` for
three workers and 3x that for `w3` (on 2 cores, 4 workers oversubscribe the CPU, so real compute
cannot show a straggler; the sleep frees the CPU as a slow GPU would); evaluation every 5 steps (or
versions, or the first round after); the target `--target` held-out accuracy. The figure: wall
time from the first committed step (version, round) to the first evaluation at or above the target,
from history's timestamps; median over `--seeds` seeds, and the ratio to BSP with the straggler.
`local_sgd` and `diloco` still wait for the straggler at every round. `shadow` never waits for anyone;
its rank 0 evaluates the replicas' average as of the newest background round. Writes a PNG (held-out
accuracy against wall time, the first seed of each side) when matplotlib is installed (the `plot`
extra).

    python benchmarks/stragglers.py [--seeds 3] [--compute-ms 20] [--target 0.93] [--png stragglers.png] [--only asp quorum]

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

SIDES = [("bsp, no straggler", "bsp", False), ("bsp", "bsp", True), ("asp", "asp", True), ("ssp (s 3)", "ssp", True),
         ("quorum (k 3)", "quorum", True), ("elastic_bsp (r 16)", "elastic_bsp", True), ("local_sgd (h 8)", "local_sgd", True),
         ("diloco (h 16)", "diloco", True), ("shadow (ma)", "shadow", True)]


def run_side(policy: str, straggler: bool, seed: int, compute_s: float, target: float, root: str) -> dict:
    stragglers = [{"slot": f"w{i}", "delay_s": compute_s * (3 if straggler and i == 3 else 1)} for i in range(4)]
    config = load_config(REPO / "configs" / f"digits_{policy}.yaml", [
        f"seed={seed}", "workers.count=4", "workers.cpus=0.5", "eval_every=5", f"run_dir={root}",
        f"name=stragglers-{policy}-{int(straggler)}-{seed}", "stop.max_steps=3000", "stop.target=null"])
    cfg = config.to_dict()
    cfg["faults"]["stragglers"] = stragglers
    cfg["stop"]["target"] = {"metric": "accuracy", "value": target}
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=900)
    history = job.history()
    if not history:
        raise RuntimeError(f"{policy}: no history ({result.state}: {result.cause})")
    start = min(r["time"] for r in history)
    curve = sorted((r["time"] - start, r["metrics"]["accuracy"]) for r in history
                   if r.get("metrics", {}).get("accuracy") is not None)
    reached = next((t for t, acc in curve if acc >= target), None)
    return {"seconds": reached, "steps": history[-1]["step"], "state": result.state, "curve": curve}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--target", type=float, default=0.93)
    parser.add_argument("--png", default="stragglers.png")
    parser.add_argument("--only", nargs="*", default=None, help="policies to run (bsp always runs, with and without the straggler)")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR", include_dashboard=False)
    root = tempfile.mkdtemp(prefix="stragglers-bench-")
    rows = {}
    for name, policy, straggler in SIDES:
        if args.only is not None and policy != "bsp" and policy not in args.only:
            continue
        runs = [run_side(policy, straggler, seed, args.compute_ms / 1000, args.target, root) for seed in range(args.seeds)]
        times = [r["seconds"] for r in runs]
        reached = [t for t in times if t is not None]
        rows[name] = {"median_s": statistics.median(reached) if len(reached) == len(times) else None,
                      "seconds": times, "steps": [r["steps"] for r in runs], "curve": runs[0]["curve"]}
        print(f"{name}: {times}", file=sys.stderr, flush=True)
    base = rows["bsp"]["median_s"]
    print(f"{'policy (4 workers, w3 3x slower)':<26}{'to ' + str(args.target) + ', s':>12}{'vs bsp':>9}  seeds")
    for name, row in rows.items():
        median = row["median_s"]
        row["ratio"] = median / base if median is not None and base else None
        shown = f"{median:12.2f}" if median is not None else f"{'not reached':>12}"
        ratio = f"{row['ratio']:9.3f}" if row["ratio"] is not None else f"{'-':>9}"
        print(f"{name:<26}{shown}{ratio}  {', '.join('-' if t is None else f'{t:.1f}' for t in row['seconds'])}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, row in rows.items():
            if row["curve"]:
                ax.plot(*zip(*row["curve"]), label=name, linestyle="--" if name.endswith("no straggler") else "-")
        ax.axhline(args.target, color="grey", linewidth=0.8)
        ax.set(xlabel="wall time from the first commit, s", ylabel="held-out accuracy", ylim=(0.5, 1.0),
               title=f"digits, 4 workers, w3 3x slower (compute {args.compute_ms:g} ms per step, modelled)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}", file=sys.stderr)
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): no PNG", file=sys.stderr)
    print(json.dumps({"benchmark": "stragglers", "seeds": args.seeds, "compute_ms": args.compute_ms, "target": args.target,
                      "rows": {k: {kk: vv for kk, vv in v.items() if kk != "curve"} for k, v in rows.items()}}))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
