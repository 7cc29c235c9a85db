"""Bytes on the wire, accuracy and time per step of compressed BSP against fp32 BSP, in one run.

Same workload on every side: the digits MLP (hidden 128), 4 workers, per-worker batch 32, SGD
(lr 0.1, momentum 0.9), the same seed and `--steps` steps (no early stop), on one local Ray. Sides:
`bsp` (fp32 all-reduce), `bsp` + `fp16`, `bytegrad` (uint8, error feedback) and `bsp` + `onebit`
(error feedback). Bytes: what rank 0's communicator counted as sent, per step, over the whole run
(from history), and the ratio to the fp32 side. Accuracy: held-out, at the last step. Time per step:
the median of history's step times after step 20. With `--seeds k`, each side runs k seeds and the
table shows medians.

    python benchmarks/compression.py [--steps 300] [--seeds 1]

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

from orchestrator.config import config_from_dict  # noqa: E402
from orchestrator.job import NAMESPACE, ElasticJob  # noqa: E402

SIDES = {
    "bsp (fp32)": ({"policy": "bsp"}, {}),
    "bsp + fp16": ({"policy": "bsp"}, {"codec": "fp16"}),
    "bytegrad (uint8, feedback)": ({"policy": "bytegrad"}, {"codec": "uint8", "feedback": True}),
    "bsp + onebit (feedback)": ({"policy": "bsp"}, {"codec": "onebit", "feedback": True}),
}


def run_side(name: str, sync: dict, compression: dict, steps: int, seed: int, root: str) -> dict:
    cfg = {"name": "compression-" + "".join(c for c in name if c.isalnum()), "seed": seed, "run_dir": root,
           "workers": {"count": 4, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 128}, "batch_size": 32},
           "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "sync": sync, "compression": compression,
           "stop": {"max_steps": steps}, "eval_every": steps}
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=900)
    if result.state != "FINISHED":
        raise RuntimeError(f"{name}: {result.state} ({result.cause})")
    history = job.history()
    step_times = [r["step_time"] for r in history if r["step"] > 20]
    return {"bytes_per_step": history[-1]["bytes_sent"] / history[-1]["step"],
            "accuracy": job.status().metrics.get("accuracy"), "step_ms": 1000 * statistics.median(step_times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args()
    ray.init(num_cpus=8, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR", include_dashboard=False)
    root = tempfile.mkdtemp(prefix="compression-bench-")
    rows = {}
    for name, (sync, compression) in SIDES.items():
        runs = [run_side(name, sync, compression, args.steps, seed, root) for seed in range(args.seeds)]
        rows[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    fp32 = rows["bsp (fp32)"]["bytes_per_step"]
    print(f"{'side (4 workers, ' + str(args.steps) + ' steps, median of ' + str(args.seeds) + ' seeds)':<44}"
          f"{'KiB/step':>10}{'vs fp32':>9}{'accuracy':>10}{'ms/step':>9}")
    for name, row in rows.items():
        row["bytes_ratio"] = row["bytes_per_step"] / fp32
        print(f"{name:<44}{row['bytes_per_step'] / 1024:>10.1f}{row['bytes_ratio']:>9.3f}"
              f"{row['accuracy']:>10.4f}{row['step_ms']:>9.2f}")
    print(json.dumps({"benchmark": "compression", "steps": args.steps, "seeds": args.seeds, "rows": rows}))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
