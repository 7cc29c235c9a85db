"""Compressed communication against the same policy uncompressed, in one run: bytes on the wire,
held-out accuracy at equal steps, time per step and each worker's peak RSS.

Same workload on every side: the digits MLP (hidden 128), 4 workers, per-worker batch 32, the same
seeds and `--steps` steps (no early stop), on one local Ray. Three groups, each against its own
uncompressed baseline:
- SGD (lr 0.1, momentum `--momentum`, 0.5 by default): `bsp` (fp32, the baseline), `bsp` + `fp16`,
  `bytegrad` (uint8 with error feedback) and `bsp` + `onebit` (error feedback).
- AdamW (lr 0.003, weight decay 1e-4, eps 1e-4): `bsp` (the baseline) and `qadam` (uint8 momentum
  after `warmup_steps` 100).
- Gossip on a ring, SGD as above: `dpsgd` (fp32 parameters, the baseline) and `choco` (uint8
  differences to the public copies).
Bytes: what rank 0's communicator counted as sent, per step, over the whole run (from history); the
ratio is to `bsp` fp32 for the all-reduce sides and to `dpsgd` for `choco`. Accuracy: held-out, at the
last step (the gossip sides: the average of the replicas). Time per step: the median of history's
step times after step 20. Peak RSS: the largest resident set of any worker process, sampled every
0.1 s. With `--seeds k` each side runs seeds 0..k-1 and the table shows medians; `delta` is the
median accuracy minus the group baseline's.

    python benchmarks/compression.py [--steps 300] [--seeds 3] [--only bsp,choco]

Prints a table, then one JSON line. Figures are measurements, not gates. Four workers on two cores
oversubscribe the CPU, so time per step here shows compute, not a network; the byte ratio is what
a slow network would feel.
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

from benchmarks.common import PeakRSS  # noqa: E402
from orchestrator.config import config_from_dict  # noqa: E402
from orchestrator.job import NAMESPACE, ElasticJob  # noqa: E402

WORKERS = 4
ADAMW = {"name": "adamw", "lr": 0.003, "weight_decay": 0.0001, "eps": 0.0001}
RING = {"kind": "ring"}


def sides(momentum: float) -> dict[str, dict]:
    """name -> sync, compression, optimizer, the group's baseline and what its bytes are compared to."""
    sgd = {"name": "sgd", "lr": 0.1, "momentum": momentum}
    return {
        "bsp (fp32)": dict(sync={"policy": "bsp"}, compression={}, optimizer=sgd, baseline="bsp (fp32)"),
        "bsp + fp16": dict(sync={"policy": "bsp"}, compression={"codec": "fp16"}, optimizer=sgd, baseline="bsp (fp32)"),
        "bytegrad (uint8, feedback)": dict(sync={"policy": "bytegrad"}, compression={"codec": "uint8", "feedback": True},
                                           optimizer=sgd, baseline="bsp (fp32)"),
        "bsp + onebit (feedback)": dict(sync={"policy": "bsp"}, compression={"codec": "onebit", "feedback": True},
                                        optimizer=sgd, baseline="bsp (fp32)"),
        "bsp + adamw (fp32)": dict(sync={"policy": "bsp"}, compression={}, optimizer=ADAMW, baseline="bsp + adamw (fp32)"),
        "qadam (uint8)": dict(sync={"policy": "qadam", "warmup_steps": 100}, compression={"codec": "uint8"},
                              optimizer=ADAMW, baseline="bsp + adamw (fp32)"),
        "dpsgd ring (fp32)": dict(sync={"policy": "dpsgd", "topology": RING, "consensus_every": 0}, compression={},
                                  optimizer=sgd, baseline="dpsgd ring (fp32)"),
        "choco ring (uint8)": dict(sync={"policy": "choco", "topology": RING, "consensus_every": 0},
                                   compression={"codec": "uint8"}, optimizer=sgd, baseline="dpsgd ring (fp32)"),
    }


def run_side(name: str, side: dict, steps: int, seed: int, root: str) -> dict:
    cfg = {"name": "compression-" + "".join(c for c in name if c.isalnum()), "seed": seed, "run_dir": root,
           "workers": {"count": WORKERS, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 128}, "batch_size": 32},
           "optimizer": side["optimizer"], "sync": side["sync"], "compression": side["compression"],
           "stop": {"max_steps": steps}, "eval_every": steps}
    job = ElasticJob(config_from_dict(cfg)).start()
    rss = PeakRSS.of_job(job, WORKERS)
    result = job.wait(timeout=900)
    peak = rss.stop()
    if result.state != "FINISHED":
        raise RuntimeError(f"{name}: {result.state} ({result.cause})")
    history = job.history()
    rank0 = [r for r in history if r.get("slot", "w0") == "w0"] or history
    step_times = [r["step_time"] for r in rank0 if r["step"] > 20]
    return {"bytes_per_step": rank0[-1]["bytes_sent"] / rank0[-1]["step"],
            "accuracy": job.status().metrics.get("accuracy"), "step_ms": 1000 * statistics.median(step_times),
            "worker_rss_mib": peak}


def measure(names: list[str], steps: int, seeds: int, momentum: float, log=sys.stderr) -> dict[str, dict]:
    """Each side's medians over `seeds` seeds, with every seed's accuracy; Ray must be up."""
    table = sides(momentum)
    root = tempfile.mkdtemp(prefix="compression-bench-")
    rows = {}
    for name in names:
        runs = [run_side(name, table[name], steps, seed, root) for seed in range(seeds)]
        rows[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        rows[name]["accuracies"] = [r["accuracy"] for r in runs]
        print(f"{name}: {rows[name]}", file=log, flush=True)
    for name, row in rows.items():
        base = table[name]["baseline"]
        bytes_base = "dpsgd ring (fp32)" if base == "dpsgd ring (fp32)" else "bsp (fp32)"
        if bytes_base in rows:
            row["bytes_ratio"] = row["bytes_per_step"] / rows[bytes_base]["bytes_per_step"]
        if base in rows:
            row["accuracy_delta"] = row["accuracy"] - rows[base]["accuracy"]
            row["rss_ratio"] = row["worker_rss_mib"] / rows[base]["worker_rss_mib"]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--momentum", type=float, default=0.5, help="the SGD sides' momentum (all of them)")
    parser.add_argument("--only", default="", help="comma-separated words: keep the sides whose name has one")
    args = parser.parse_args()
    names = [n for n in sides(args.momentum)
             if not args.only or any(word in n for word in args.only.split(","))]
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR", include_dashboard=False)
    rows = measure(names, args.steps, args.seeds, args.momentum)
    print(f"{'side (4 workers, ' + str(args.steps) + ' steps, median of ' + str(args.seeds) + ' seeds)':<46}"
          f"{'KiB/step':>10}{'bytes ratio':>12}{'accuracy':>10}{'delta':>8}{'ms/step':>9}{'RSS MiB':>9}")
    for name, row in rows.items():
        ratio, delta = row.get("bytes_ratio"), row.get("accuracy_delta")
        print(f"{name:<46}{row['bytes_per_step'] / 1024:>10.1f}{'' if ratio is None else f'{ratio:.3f}':>12}"
              f"{row['accuracy']:>10.4f}{'' if delta is None else f'{delta:+.4f}':>8}{row['step_ms']:>9.2f}"
              f"{row['worker_rss_mib']:>9.0f}")
    print(json.dumps({"benchmark": "compression", "steps": args.steps, "seeds": args.seeds,
                      "sgd_momentum": args.momentum, "rows": rows}))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
