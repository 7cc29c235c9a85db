"""Time per step of the orchestrator's worker on one GPU, next to a plain single-process torch loop.

Both sides train the same synthetic MLP (orchestrator/workloads/synthetic.py) with SGD on the same
GPU, copying each batch from host memory, one after the other in this process. The orchestrator
side is the worker's real step loop (actors/training/replica.py) at world size 1 over NCCL (or gloo with
`--backend gloo`): buckets, hooks, the commit vote and the history records included. Timed per
step after a warm-up: the plain loop from a CUDA event recorded at the end of each step (no host
synchronization in its loop: the events are read after the last step), the orchestrator from its
history records (each written once the step committed). The default model
makes a plain step take well over 50 ms on an H100 in fp32.

    python benchmarks/gpu_step.py [--width 4096] [--depth 8] [--batch 8192] [--steps 60] [--backend nccl]
                                  [--engine auto] [--shared 3] [--shared-steps 300]

`--shared N` (default 3; 0 skips it) adds the fractional-GPU figure: N orchestrator workers sharing
the one GPU (`workers.gpus: 1/N`, gloo with CUDA tensors) as a real job on a local Ray, next to N
plain `DistributedDataParallel` processes over gloo on the same GPU, on a smaller synthetic MLP
(width 1024, depth 4, per-worker batch 256), in alternating pairs; steps/s of rank 0 over the
steps after a warm-up, and the ratio's median.

Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from orchestrator.workloads.synthetic import mlp  # noqa: E402
from testkit.harness import LocalJob  # noqa: E402
from testkit.peers import ddp_store  # noqa: E402

WARMUP = 10
SHARED = {"width": 1024, "depth": 4}
SHARED_BATCH, SHARED_WARMUP = 256, 30


def plain(params: dict, batch: int, steps: int, lr: float) -> list[float]:
    torch.manual_seed(0)
    workload = mlp(**params)
    model = workload.model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    x_all, y_all = workload.train_data.tensors
    ends = []
    for step in range(steps):
        index = torch.randint(0, len(x_all), (batch,), generator=torch.Generator().manual_seed(step))
        x, y = x_all[index].cuda(non_blocking=True), y_all[index].cuda(non_blocking=True)
        opt.zero_grad(set_to_none=True)
        workload.loss(model, (x, y)).backward()
        opt.step()
        end = torch.cuda.Event(enable_timing=True)
        end.record()  # no host sync in the loop: each step's end is an event, read after the last step
        ends.append(end)
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1000.0 for a, b in zip(ends[WARMUP:], ends[WARMUP + 1:])]


def orchestrator(params: dict, batch: int, steps: int, lr: float, backend: str, engine: str = "auto") -> list[float]:
    cfg = {"name": "gpu-step", "seed": 0, "workers": {"count": 1, "cpus": 1, "gpus": 1},
           "workload": {"factory": "orchestrator.workloads.synthetic:mlp", "params": params, "batch_size": batch},
           "optimizer": {"name": "sgd", "lr": lr}, "sync": {"policy": "bsp", "engine": engine}, "comm": {"backend": backend},
           "stop": {"max_steps": steps}, "eval_every": 0}
    job = LocalJob(cfg, ["w0"], tempfile.mkdtemp(prefix="gpu-step-"))
    job.run(("w0",), batch, backend=backend, timeout=900)
    stamps = [r["time"] for r in sorted(job.link.records, key=lambda r: r["step"])]
    return [b - a for a, b in zip(stamps[WARMUP:], stamps[WARMUP + 1:])]


def _ddp_rank(rank: int, world: int, steps: int, out_dir: str) -> None:
    """One plain DDP process over gloo with CUDA tensors on the shared GPU."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=ddp_store(rank, out_dir, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    workload = mlp(**SHARED)
    model = DistributedDataParallel(workload.model.cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x_all, y_all = workload.train_data.tensors
    stamps = []
    for step in range(steps):
        index = torch.randint(0, len(x_all), (SHARED_BATCH,), generator=torch.Generator().manual_seed(step * world + rank))
        opt.zero_grad(set_to_none=False)
        workload.loss(model, (x_all[index].cuda(non_blocking=True), y_all[index].cuda(non_blocking=True))).backward()
        opt.step()
        torch.cuda.synchronize()
        stamps.append(time.time())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(stamps))
    dist.barrier()
    dist.destroy_process_group()


def shared_ddp(world: int, steps: int) -> float:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_ddp_rank, args=(world, steps, out), nprocs=world, join=True, start_method="spawn")
        stamps = json.loads(Path(out, "rank0.json").read_text())
    return (steps - 1 - SHARED_WARMUP) / (stamps[-1] - stamps[SHARED_WARMUP])


def shared_orchestrator(world: int, steps: int) -> float:
    from orchestrator.config import config_from_dict
    from orchestrator.job import ElasticJob

    cfg = {"name": f"gpu-shared-{time.monotonic_ns()}", "seed": 0,
           "workers": {"count": world, "cpus": 1, "gpus": round(1.0 / world, 3)},
           "workload": {"factory": "orchestrator.workloads.synthetic:mlp", "params": SHARED, "batch_size": SHARED_BATCH},
           "optimizer": {"name": "sgd", "lr": 0.01}, "sync": {"policy": "bsp"}, "comm": {"backend": "gloo"},
           "stop": {"max_steps": steps}, "eval_every": 0}
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=900)
    if result.state != "FINISHED":
        raise RuntimeError(f"the shared-GPU job ended {result.state}: {result.cause}")
    times = {r["step"]: r["time"] for r in job.history()}
    return (steps - SHARED_WARMUP - 1) / (times[steps] - times[SHARED_WARMUP + 1])


def shared(world: int, steps: int, pairs: int) -> dict:
    import ray

    from orchestrator.job import NAMESPACE, ensure_token_env

    os.environ.setdefault("ORCHESTRATOR_RUN_ROOT", tempfile.mkdtemp(prefix="gpu-step-runs-"))
    ensure_token_env()
    ray.init(address="local", num_cpus=world + 2, num_gpus=1, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False)
    ratios, sides = [], {"orchestrator": [], "ddp": []}
    try:
        for _ in range(pairs):
            o, d = shared_orchestrator(world, steps), shared_ddp(world, steps)
            sides["orchestrator"].append(o)
            sides["ddp"].append(d)
            ratios.append(o / d)
    finally:
        ray.shutdown()
    return {"workers": world, "orchestrator_steps_per_s": statistics.median(sides["orchestrator"]),
            "ddp_steps_per_s": statistics.median(sides["ddp"]), "ratio": statistics.median(ratios),
            "ratios": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--engine", default="auto", choices=["auto", "reducer", "python"])
    parser.add_argument("--shared", type=int, default=3, help="workers sharing the GPU over gloo (0: skip)")
    parser.add_argument("--shared-steps", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 1
    params = {"width": args.width, "depth": args.depth}
    runs = {}
    for side in ("plain", "orchestrator", "plain", "orchestrator"):  # alternating, then the medians
        step_s = plain(params, args.batch, args.steps, 0.01) if side == "plain" else \
            orchestrator(params, args.batch, args.steps, 0.01, args.backend, args.engine)
        runs.setdefault(side, []).extend(step_s)
    p, o = statistics.median(runs["plain"]), statistics.median(runs["orchestrator"])
    gpu = torch.cuda.get_device_name()
    print(f"{'metric (median over steps ' + str(WARMUP) + '..' + str(args.steps) + ', 2 runs each)':<56}{'value':>14}")
    print(f"{'plain torch step, ms':<56}{p * 1000:>14.2f}")
    print(f"{'orchestrator worker step (world size 1, ' + args.backend + '), ms':<56}{o * 1000:>14.2f}")
    print(f"{'overhead':<56}{(o / p - 1) * 100:>13.1f}%")
    fraction = shared(args.shared, args.shared_steps, args.pairs) if args.shared > 0 else None
    if fraction:
        n = fraction["workers"]
        print(f"{f'{n} workers sharing the GPU over gloo: orchestrator steps/s':<56}{fraction['orchestrator_steps_per_s']:>14.2f}")
        print(f"{f'{n} plain DDP processes over gloo on the same GPU: steps/s':<56}{fraction['ddp_steps_per_s']:>14.2f}")
        print(f"{'ratio (median of ' + str(args.pairs) + ' pairs)':<56}{fraction['ratio']:>14.3f}")
    print(json.dumps({"benchmark": "gpu_step", "gpu": gpu, "torch": torch.__version__, "backend": args.backend,
                      "engine": args.engine, "width": args.width, "depth": args.depth, "batch": args.batch,
                      "plain_step_ms": p * 1000, "orchestrator_step_ms": o * 1000, "overhead": o / p - 1,
                      "shared": fraction}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
