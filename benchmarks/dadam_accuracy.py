"""Held-out accuracy at equal steps: `dadam` (decentralized Adam with accumulation, `k` steps a fold)
against `dpsgd` with a local AdamW (which is `dadam` at k = 1), on digits.

Every side runs `--workers` real replicas in threads of this process (the worker's own step loop over
in-process gloo, no Ray), on a ring, with the same AdamW hyperparameters, per-worker batch and seeds;
the model evaluated is the replicas' average after `--steps` steps (the final model of a
decentralized job). Small per-worker batches are where the paper's accumulation is meant to help.
Each side's figure is the median over `--seeds` seeds.

    python benchmarks/dadam_accuracy.py [--steps 300] [--seeds 3] [--batch 8] [--lr 0.003] [--ks 4 8]

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

import torch  # noqa: E402

from orchestrator.workloads.digits import accuracy, mlp  # noqa: E402
from testkit.harness import LocalJob  # noqa: E402


def run(sync: dict, seed: int, args) -> float:
    slots = [f"w{i}" for i in range(args.workers)]
    cfg = {"name": "dadam-acc", "seed": seed, "workers": {"count": args.workers, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 64}, "batch_size": args.batch},
           "optimizer": {"name": "adamw", "lr": args.lr, "weight_decay": 0.01},
           "sync": {**sync, "topology": {"kind": "ring"}, "consensus_every": 0}, "stop": {"max_steps": args.steps},
           "eval_every": 0}
    job = LocalJob(cfg, slots, tempfile.mkdtemp(prefix="dadam-acc-"))
    job.run(tuple(slots), args.batch * args.workers, timeout=1800)
    model = job.replicas["w0"].training.model
    average = [torch.stack([p.detach() for p in ps]).mean(0)
               for ps in zip(*[job.replicas[s].training.model.parameters() for s in slots])]
    with torch.no_grad():
        for p, a in zip(model.parameters(), average):
            p.copy_(a)
    return accuracy(model, mlp().eval_data)["accuracy"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    sides = {"dpsgd + AdamW (dadam k=1)": {"policy": "dpsgd"}}
    sides.update({f"dadam k={k}": {"policy": "dadam", "k": k} for k in args.ks})
    results = {}
    for name, sync in sides.items():
        accs = [run(sync, seed, args) for seed in range(args.seeds)]
        results[name] = {"median": statistics.median(accs), "runs": accs}
        print(f"{name}: {accs}", file=sys.stderr, flush=True)
    base = results["dpsgd + AdamW (dadam k=1)"]["median"]
    print(f"{'side (median of ' + str(args.seeds) + ' seeds, ' + str(args.steps) + ' steps)':<44}{'accuracy':>10}{'vs dpsgd':>10}")
    for name, r in results.items():
        print(f"{name:<44}{r['median']:>10.4f}{(r['median'] - base) * 100:>+9.2f}pt")
    print(json.dumps({"benchmark": "dadam_accuracy", "workers": args.workers, "steps": args.steps, "batch": args.batch,
                      "lr": args.lr, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
