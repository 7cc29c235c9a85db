"""The sides of the compression benchmark (`benchmarks/compression.py`, and the slow tier's accuracy gate in
`tests/e2e/test_policy_accuracy.py`): compressed communication against the same policy uncompressed, each side a
job of the digits MLP (hidden 128), 4 workers, per-worker batch 32, on the Ray this process is connected to,
measured for bytes sent a step, held-out accuracy at the last step, time per step and each worker's peak RSS.
"""
from __future__ import annotations

import statistics
import sys
import tempfile

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.peers import PeakRSS

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
