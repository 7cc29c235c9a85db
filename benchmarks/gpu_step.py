"""Time per step of the orchestrator's worker on one GPU, next to a plain single-process torch loop.

Both sides train the same synthetic MLP (orchestrator/workloads/synthetic.py) with SGD on the same
GPU, copying each batch from host memory, one after the other in this process. The orchestrator
side is the worker's real step loop (actors/replica.py) at world size 1 over NCCL (or gloo with
`--backend gloo`): buckets, hooks, the commit vote and the history records included. Timed per
step after a warm-up: the plain loop with a CUDA synchronize at each end of the window, the
orchestrator from its history records (each written once the step committed). The default model
makes a plain step take well over 50 ms on an H100 in fp32.

    python benchmarks/gpu_step.py [--width 4096] [--depth 8] [--batch 8192] [--steps 60] [--backend nccl]

Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from actors.testing import LocalJob  # noqa: E402
from orchestrator.workloads.synthetic import mlp  # noqa: E402

WARMUP = 10


def plain(params: dict, batch: int, steps: int, lr: float) -> list[float]:
    torch.manual_seed(0)
    workload = mlp(**params)
    model = workload.model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    x_all, y_all = workload.train_data.tensors
    times = []
    for step in range(steps):
        index = torch.randint(0, len(x_all), (batch,), generator=torch.Generator().manual_seed(step))
        x, y = x_all[index].cuda(non_blocking=True), y_all[index].cuda(non_blocking=True)
        opt.zero_grad(set_to_none=True)
        workload.loss(model, (x, y)).backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter())
    return [b - a for a, b in zip(times[WARMUP:], times[WARMUP + 1:])]


def orchestrator(params: dict, batch: int, steps: int, lr: float, backend: str) -> list[float]:
    cfg = {"name": "gpu-step", "seed": 0, "workers": {"count": 1, "cpus": 1, "gpus": 1},
           "workload": {"factory": "orchestrator.workloads.synthetic:mlp", "params": params, "batch_size": batch},
           "optimizer": {"name": "sgd", "lr": lr}, "sync": {"policy": "bsp"}, "comm": {"backend": backend},
           "stop": {"max_steps": steps}, "eval_every": 0}
    job = LocalJob(cfg, ["w0"], tempfile.mkdtemp(prefix="gpu-step-"))
    job.run(("w0",), batch, backend=backend, timeout=900)
    stamps = [r["time"] for r in sorted(job.link.records, key=lambda r: r["step"])]
    return [b - a for a, b in zip(stamps[WARMUP:], stamps[WARMUP + 1:])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 1
    params = {"width": args.width, "depth": args.depth}
    runs = {}
    for side in ("plain", "orchestrator", "plain", "orchestrator"):  # alternating, then the medians
        step_s = plain(params, args.batch, args.steps, 0.01) if side == "plain" else \
            orchestrator(params, args.batch, args.steps, 0.01, args.backend)
        runs.setdefault(side, []).extend(step_s)
    p, o = statistics.median(runs["plain"]), statistics.median(runs["orchestrator"])
    gpu = torch.cuda.get_device_name()
    print(f"{'metric (median over steps ' + str(WARMUP) + '..' + str(args.steps) + ', 2 runs each)':<56}{'value':>14}")
    print(f"{'plain torch step, ms':<56}{p * 1000:>14.2f}")
    print(f"{'orchestrator worker step (world size 1, ' + args.backend + '), ms':<56}{o * 1000:>14.2f}")
    print(f"{'overhead':<56}{(o / p - 1) * 100:>13.1f}%")
    print(json.dumps({"benchmark": "gpu_step", "gpu": gpu, "torch": torch.__version__, "backend": args.backend,
                      "width": args.width, "depth": args.depth, "batch": args.batch, "plain_step_ms": p * 1000,
                      "orchestrator_step_ms": o * 1000, "overhead": o / p - 1}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
