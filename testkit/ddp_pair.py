"""The two sides of BSP against torch DDP (`benchmarks/bsp_vs_ddp.py`, and the slow tier's speed gate
`tests/e2e/test_speed.py`): the same workload, built by the same factory and trained with its own loss, the
same global-batch sampler, 2 workers, 25 MiB buckets and one torch thread a worker, through the
orchestrator's job and through plain `DistributedDataParallel` over gloo.

`digits` is the digits MLP (hidden 128), per-worker batch 32, SGD (lr 0.05, momentum 0.9); `lm` the
byte-level GPT (`orchestrator.workloads.lm:gpt`, tiny), per-worker batch 8, AdamW (lr 0.003). DDP's side
uses torch's own optimizer (`foreach=False`) and gathers its rows as a user writes it (`t[ids]`).
Throughput is timed on rank 0 with the same timer (`time.time()` after each optimizer step) over a window
of steps; peak RSS is the largest worker process of each side (`testkit/peers.py` `PeakRSS`).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The same imports on both sides.
import numpy as np  # noqa: F401 - imported on both sides alike (the DDP ranks import this module)
import torch
import torch.multiprocessing as mp

from algorithms.rules.sampler import GlobalSampler, split_for_rank
from testkit.peers import PeakRSS, ddp_store, peer_workload

WORKERS, BUCKET_MB, SEED = 2, 25.0, 0
WINDOW = (50, 550)
"""The steps throughput is timed over."""
WORKLOADS: dict[str, dict[str, Any]] = {
    "digits": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 128}, "per_worker": 32,
               "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
    "lm": {"factory": "orchestrator.workloads.lm:gpt", "params": {"size": "tiny"}, "per_worker": 8,
           "optimizer": {"name": "adamw", "lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.01}},
}


def build(name: str):
    """The workload (seeded as a job seeds it) and a factory of torch's own optimizer for it (what a DDP
    user writes), its per-tensor loop as on the job's side."""
    return peer_workload(WORKLOADS[name], SEED, foreach=False)


def batch_of(data, ids: torch.Tensor):
    """The rows for `ids`, gathered as a user writes it."""
    return tuple(t[ids] for t in data.tensors)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def steps_per_s(times: dict[int, float], first: int, last: int) -> float:
    return (last - first) / (times[last] - times[first])


def _ddp_rank(rank: int, steps: int, out_dir: str, name: str, niceness: int = 0) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    if niceness:
        os.nice(niceness)
    store = ddp_store(rank, out_dir, WORKERS)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORKERS)
    workload, make_opt = build(name)
    model = DistributedDataParallel(workload.model, bucket_cap_mb=BUCKET_MB)
    opt = make_opt(model.parameters())
    data = workload.train_data
    sampler = GlobalSampler(len(data), SEED)
    global_batch = WORKERS * WORKLOADS[name]["per_worker"]
    times: dict[int, float] = {}
    for step in range(1, steps + 1):
        ids = torch.from_numpy(split_for_rank(sampler.global_batch((step - 1) * global_batch, global_batch), rank, WORKERS))
        opt.zero_grad(set_to_none=False)
        workload.loss(model, batch_of(data, ids)).backward()
        opt.step()
        if rank == 0:
            times[step] = time.time()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"times": times}))
    dist.barrier()  # rank 0 serves the store: it leaves last
    if rank == 0:
        time.sleep(0.5)
    dist.destroy_process_group()


def run_ddp(steps: int, name: str, niceness: int = 0, window: tuple[int, int] = WINDOW) -> dict:
    """DDP's side: its ranks as processes of their own (as torchrun starts them, at `niceness`)."""
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(_ddp_rank, args=(steps, out, name, niceness), nprocs=WORKERS, join=False)
        rss = PeakRSS(lambda: [p.pid for p in context.processes])
        try:
            while not context.join():
                pass
        except mp.ProcessExitedException as err:  # torch's teardown can abort after the timed loop
            if not all(Path(out, f"rank{r}.json").exists() for r in range(WORKERS)):
                raise
            log(f"DDP: a rank exited badly after writing its timings ({err}); the timings stand")
        peak = rss.stop()
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORKERS)]
    times = {int(k): v for k, v in ranks[0]["times"].items()}
    return {"steps_per_s": steps_per_s(times, *window), "rss_mib": peak}


def job_config(name: str, steps: int, engine: str = "auto", workload: str = "digits", overrides: Sequence[str] = ()):
    """The orchestrator side's job (also profiled by benchmarks/profile_step.py); `overrides` as `--set` gives them."""
    from orchestrator.config import config_from_dict

    w = WORKLOADS[workload]
    return config_from_dict({
        "name": name, "seed": SEED, "workers": {"count": WORKERS, "cpus": 1},
        "workload": {"factory": w["factory"], "params": w["params"], "batch_size": w["per_worker"]},
        "optimizer": w["optimizer"],
        "sync": {"policy": "bsp", "bucket_mb": BUCKET_MB, "engine": engine}, "stop": {"max_steps": steps}, "eval_every": 0,
    }, list(overrides))


def run_orchestrator(name: str, steps: int, workload: str, overrides: Sequence[str] = (),
                     window: tuple[int, int] = WINDOW) -> dict:
    """The orchestrator's side: a BSP job on the Ray this process is connected to."""
    from orchestrator.job import ElasticJob

    before = time.time()
    job = ElasticJob(job_config(name, steps, workload=workload, overrides=overrides)).start()
    rss = PeakRSS.of_job(job, WORKERS)
    result = job.wait(timeout=600)
    peak = rss.stop()
    if result.state != "FINISHED":
        raise RuntimeError(f"orchestrator run {name} ended {result.state}: {result.cause}")
    times = {r["step"]: r["time"] for r in job.history()}
    return {"steps_per_s": steps_per_s(times, *window), "rss_mib": peak, "startup_s": times[1] - before}
