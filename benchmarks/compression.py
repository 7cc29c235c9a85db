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
a slow network would feel. The sides are `testkit/compression_sides.py` (the slow tier's accuracy gate
runs them too).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import ray  # noqa: E402

from orchestrator.job import NAMESPACE  # noqa: E402
from testkit.compression_sides import measure, sides  # noqa: E402


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
