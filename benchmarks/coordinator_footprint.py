"""What a job's coordinator process costs: resident memory, CPU seconds, and whether torch is loaded.

Starts a local Ray, then `--runs` BSP jobs of 3 workers one after the other (digits MLP, hidden 32),
and at step 30 of each reads the coordinator's resident set size, its CPU seconds so far (user +
system, from its start: the imports, the first plan, 30 steps of reports), whether `libtorch` is
mapped in it, and the workers' mean resident set size. Since each worker serves the group store
its epochs rendezvous on (actors/training/worker.py `HostedStore`), no coordinator loads torch.

    python benchmarks/coordinator_footprint.py [--runs 3] [--out FILE]

Prints one line per job and a JSON line with the medians (appended to --out if given). To compare
with another commit, run it from a worktree of that commit with `PYTHONPATH` set to the worktree
(the local Ray's processes inherit it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import psutil
import ray

from orchestrator.config import config_from_dict
from orchestrator.job import NAMESPACE, ElasticJob, ensure_token_env

STEP = 30


def measure(index: int) -> dict:
    cfg = {"name": f"footprint{index}", "seed": 1, "workers": {"count": 3, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 16},
           "stop": {"max_steps": 1_000_000}, "eval_every": 0}
    job = ElasticJob(config_from_dict(cfg)).start()
    try:
        deadline = time.monotonic() + 120
        while (status := job.status()).step < STEP:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {cfg['name']} did not reach step {STEP} within 120 s")
            time.sleep(0.05)
        coordinator = psutil.Process(status.coordinator_pid)
        cpu = coordinator.cpu_times()
        with open(f"/proc/{coordinator.pid}/maps") as maps:
            torch_loaded = "libtorch" in maps.read()
        workers = [psutil.Process(m.pid).memory_info().rss for m in status.members]
        return {"coordinator_rss_mib": round(coordinator.memory_info().rss / 2**20, 1),
                "coordinator_cpu_s": round(cpu.user + cpu.system, 2), "coordinator_torch": torch_loaded,
                "worker_rss_mib": round(sum(workers) / len(workers) / 2**20, 1)}
    finally:
        job.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="append the JSON line to this file")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    os.environ.setdefault("ORCHESTRATOR_RUN_ROOT", tempfile.mkdtemp(prefix="footprint-"))
    ensure_token_env()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    rows = []
    for index in range(args.runs):
        rows.append(measure(index))
        print(f"job {index + 1}/{args.runs}: {rows[-1]}", flush=True)
    ray.shutdown()
    line = {"benchmark": "coordinator_footprint", "runs": args.runs, "at_step": STEP,
            **{f"median_{key}": statistics.median(r[key] for r in rows)
               for key in ("coordinator_rss_mib", "coordinator_cpu_s", "worker_rss_mib")},
            "coordinator_torch": any(r["coordinator_torch"] for r in rows), "rows": rows}
    print(json.dumps(line))
    if args.out:
        with open(args.out, "a") as out:
            out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
