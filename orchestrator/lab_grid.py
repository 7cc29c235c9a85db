"""The network lab's grid: every policy `plan` weighs, run as a real job on the lab (`orchestrator/lab.py`) in
each cell of networks x compute conditions, one result row per policy, cell and seed, with the runtime model's
prediction of its time per step.

Setting (one cell = one network x one condition):
- `Grid.workers` workers (4 by default) on lab nodes of 2 (w0, w1 on node 0; w2, w3 on node 1), gloo on CPU;
  the links between the nodes shaped by the kernel (`tc` htb) at `10g` (10 Gbit/s, 0.05 ms modelled one-way
  latency), `1g` (1 Gbit/s, 0.2 ms) or `100m` (100 Mbit/s, 1 ms); within a node, loopback.
- The workload: the digits MLP with 2 hidden layers of `hidden` units (512: 1.2 MB of float32 parameters)
  and a modelled compute of `compute_ms` per step, slept inside the forward pass
  (`orchestrator.workloads.digits:lab_mlp`; on 2 cores, 4 workers cannot show compute otherwise).
- Conditions: `none`; `straggler` (w1 computes 3x as long); `jitter` (every step's compute on every worker
  times a lognormal factor, sigma 0.5, median 1).
- SGD at `lr`, momentum 0.9, per-worker batch 32; the target held-out accuracy evaluated every 5 steps, at
  most `max_steps` steps. The decentralized policies run with `consensus_every: 0`.

Each row: time per step, bytes per step, time and steps to the target (`orchestrator/calibration.py`), and
what the model was fed (the probed links, one step's compute among the placed workers, each pattern's host
time). `benchmarks/tradeoffs.py` runs the whole grid and reports it; `python -m orchestrator calibrate
--measure` runs its `10g`/`none` cell, where the convergence factors are counted. Needs root and `tc`.
"""
from __future__ import annotations

import json
import logging
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from core.schema import ConfigError
from orchestrator.calibration import (
    BATCH,
    HIDDEN,
    LR,
    PER_NODE,
    TARGET,
    TIMED_FROM_START,
    WORKERS,
    accuracy_evals,
    bytes_per_step,
    first_at,
    load,
    per_step,
)

NETWORKS = {"10g": (10000.0, 0.05), "1g": (1000.0, 0.2), "100m": (100.0, 1.0)}
"""Each network's inter-node rate (Mbit/s) and modelled one-way latency (ms)."""
CONDITIONS = ("none", "straggler", "jitter")


@dataclass(frozen=True)
class Grid:
    """What to run: the cells (`networks` x `conditions`), every candidate (or those `only` names, by label
    or policy) once per seed, at one rate and world size."""
    networks: tuple[str, ...] = tuple(NETWORKS)
    conditions: tuple[str, ...] = CONDITIONS
    only: frozenset[str] = frozenset()
    seeds: tuple[int, ...] = (0,)
    lr: float = LR
    workers: int = WORKERS
    compute_ms: float = 15.0
    """About what the ring all-reduce of the gradients takes at 1 Gbit/s."""
    hidden: int = HIDDEN
    target: float = TARGET
    max_steps: int = 600
    resume: bool = False
    """Skip the (policy, network, condition, seed) already in the result file, and append; else start it afresh."""

    def __post_init__(self) -> None:
        if self.workers < PER_NODE or self.workers % PER_NODE:
            raise ConfigError(f"--workers: {self.workers} is not a positive multiple of {PER_NODE} "
                              f"(the lab puts {PER_NODE} on a node)")
        unknown = [n for n in self.networks if n not in NETWORKS] + [c for c in self.conditions if c not in CONDITIONS]
        if unknown:
            raise ConfigError(f"no such network or condition: {', '.join(unknown)} (networks: {', '.join(NETWORKS)}; "
                              f"conditions: {', '.join(CONDITIONS)})")


def job_dict(label: str, cand, network: str, condition: str, grid: Grid, seed: int, root: str) -> dict:
    mbit, latency = NETWORKS[network]
    params: dict = {"hidden": grid.hidden, "depth": 2, "compute_ms": grid.compute_ms, "seed": seed}
    if condition == "straggler":
        params["slow"] = {"w1": 3.0}
    elif condition == "jitter":
        params["jitter_sigma"] = 0.5
    sync = dict(cand.sync)
    if sync["policy"] in ("dpsgd", "dadam", "choco"):
        sync["consensus_every"] = 0
    name = "tradeoffs-" + "".join(ch if ch.isalnum() else "-" for ch in f"{label}-{network}-{condition}")
    return {"name": name[:64], "seed": seed, "run_dir": root,
            "workers": {"count": grid.workers, "cpus": 0.5},
            "workload": {"factory": "orchestrator.workloads.digits:lab_mlp", "params": params, "batch_size": BATCH},
            "optimizer": {"name": "sgd", "lr": grid.lr, "momentum": 0.9},
            "sync": sync, "compression": dict(cand.compression) or {"codec": "none"},
            "network": {"nodes": grid.workers // PER_NODE, "workers_per_node": PER_NODE,
                        "inter": {"mbit": mbit, "latency_ms": latency}},
            "stop": {"max_steps": grid.max_steps, "target": {"metric": "accuracy", "value": grid.target}},
            "eval_every": 5}


def placed_step_s(cfg: dict, steps: int) -> float:
    """Time per step (after step 10) of job `cfg` run for `steps` steps without a network: one step's
    compute as the placed workers see it, with their CPU contention (its `sync` communicates rarely)."""
    from orchestrator.config import config_from_dict
    from orchestrator.job import ElasticJob

    cfg = {**cfg, "stop": {"max_steps": steps}}
    cfg.pop("network", None)
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=600)
    if result.state != "FINISHED":
        raise RuntimeError(f"the compute probe ended {result.state}: {result.cause}")
    return per_step(job.history())


def run_cell(label: str, cand, network: str, condition: str, grid: Grid, root: str, seed: int = 0) -> dict:
    from orchestrator.config import config_from_dict
    from orchestrator.job import ElasticJob

    job = ElasticJob(config_from_dict(job_dict(label, cand, network, condition, grid, seed, root))).start()
    result = job.wait(timeout=1200)
    history = job.history()
    if not history:
        raise RuntimeError(f"{label} {network} {condition}: no history ({result.state}: {result.cause})")
    evals = accuracy_evals(history)
    hit = first_at(evals, grid.target)
    return {"policy": label, "network": network, "condition": condition, "seed": seed, "lr": grid.lr,
            "workers": grid.workers, "hidden": grid.hidden, "target": grid.target, "state": result.state,
            "step_s": per_step(history), "bytes_per_step": bytes_per_step(history),
            "to_target_s": hit[0], "timed_from": TIMED_FROM_START, "steps_to_target": hit[1],
            "steps": max(r["step"] for r in history),
            "best_accuracy": max((acc for _, _, acc in evals), default=None)}


def cell_network(network: str, probed: list[dict], host_s=None, workers: int = WORKERS):
    """The model's view of a cell's network: the lab's links as probed, and each synchronization
    pattern's host time on this machine (`planner.measure_host`; None in rows written before it was
    measured: none counted)."""
    from orchestrator.config import config_from_dict
    from orchestrator.planner import network_for

    mbit, latency = NETWORKS[network]
    cfg = config_from_dict({"name": "x", "workers": {"count": workers}, "workload": {"factory": "orchestrator.workloads.digits:mlp"},
                            "network": {"nodes": workers // PER_NODE, "workers_per_node": PER_NODE,
                                        "inter": {"mbit": mbit, "latency_ms": latency}}})
    return network_for(cfg.network, workers, probed, host_s)


def cell_compute(condition: str, step_s: float, modelled_s: float):
    """The model's compute side: `step_s` per step among the placed workers (`placed_compute`), of which
    the modelled `modelled_s` is what the straggler (3x) and the jitter (sigma 0.5) scale, as
    `lab_mlp` scales only its sleep."""
    from algorithms.rules.runtime_model import Compute

    return Compute(modelled_s, fixed_s=max(step_s - modelled_s, 0.0),
                   factors=(1.0, 3.0, 1.0, 1.0) if condition == "straggler" else (),
                   jitter_sigma=0.5 if condition == "jitter" else 0.0)


def placed_compute(grid: Grid, root: str) -> float:
    """The compute time of one step as the placed workers see it (the probe's measurement): the same
    workers, workload, evaluation cadence and CPU contention, communicating once in 20 steps (`local_sgd`,
    h 20, unshaped: a round on loopback adds well under 1 ms a step); time per step after step 10."""
    from algorithms.rules.runtime_model import PolicySpec
    from orchestrator.planner import Candidate

    quiet = Candidate("calibration", {"policy": "local_sgd", "h": 20}, {}, PolicySpec("local_sgd"))
    return placed_step_s(job_dict("calibration", quiet, "10g", "none", grid, 0, root), 100)


def predict_cell(cand, network: str, condition: str, probed: list[dict], step_s: float, modelled_s: float,
                 model_bytes: float, host_s=None, workers: int = WORKERS) -> float:
    from algorithms.rules.runtime_model import predict

    return predict(cand.spec, cell_network(network, probed, host_s, workers),
                   cell_compute(condition, step_s, modelled_s), model_bytes).step_s


def lab_ready() -> bool:
    """Whether the lab can run here (root and `tc`; else the reason on stderr, one line); a SIGTERM then
    unwinds the process, so the lab comes down on a kill too."""
    from orchestrator import lab

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        lab.check_privileges()
    except lab.LabUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return False
    return True


def measure(grid: Grid, out: Path) -> int:
    """Run `grid` on the lab, appending each row to `out` as its run ends; 2 where the lab cannot run here."""
    import ray

    from orchestrator import lab, planner
    from orchestrator.config import config_from_dict
    from orchestrator.job import NAMESPACE, ensure_token_env

    if not lab_ready():
        return 2
    done = {(r["policy"], r["network"], r["condition"], r.get("seed", 0)) for r in load(out)} if grid.resume else set()
    if not grid.resume:
        out.write_text("")
    base = config_from_dict({"name": "x", "workers": {"count": grid.workers},
                             "workload": {"factory": "orchestrator.workloads.digits:mlp"},
                             "network": {"nodes": grid.workers // PER_NODE, "workers_per_node": PER_NODE}})
    cands = [c for c in planner.candidates(base) if not grid.only or c.label in grid.only or c.sync["policy"] in grid.only]
    measured = config_from_dict(job_dict("bsp", cands[0], "10g", "none", grid, 0, "/tmp"))
    alone_s, model_bytes = planner.measure_compute(measured)
    ensure_token_env()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False,
             logging_level=logging.ERROR)
    root = tempfile.mkdtemp(prefix="tradeoffs-")
    compute_s, modelled_s = placed_compute(grid, root), grid.compute_ms / 1e3
    host_s = planner.measure_host(measured, cands, model_bytes)
    print(f"one step's compute: {alone_s * 1e3:.2f} ms in one process, {compute_s * 1e3:.2f} ms among the {grid.workers} "
          f"placed workers (modelled sleep {grid.compute_ms} ms of it); model {model_bytes / 1e6:.3f} MB; each pattern's "
          f"synchronization among {grid.workers} ranks on this machine: "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(host_s.items())), flush=True)
    for network in grid.networks:
        net_cfg = config_from_dict(job_dict("bsp", cands[0], network, "none", grid, 0, root)).network
        with lab.Lab(net_cfg):
            probed = lab.probe(net_cfg)
            for row in probed:
                print(f"[{network}] link {row['a']}->{row['b']}: asked {row['asked_mbit'] or 'unshaped'} Mbit/s, "
                      f"measured {row['measured_mbit']:.0f}, rtt {row['rtt_ms']:.3f} ms", flush=True)
            for condition in grid.conditions:
                for cand, seed in [(c, s) for s in grid.seeds for c in cands]:
                    if (cand.label, network, condition, seed) in done:
                        continue
                    began = time.time()
                    row = run_cell(cand.label, cand, network, condition, grid, root, seed)
                    row.update(predicted_step_s=predict_cell(cand, network, condition, probed, compute_s, modelled_s,
                                                             model_bytes, host_s, grid.workers),
                               compute_s=compute_s, modelled_s=modelled_s, model_bytes=model_bytes, probed=probed,
                               host_s=host_s)
                    with open(out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"[{network}/{condition}, seed {seed}] {cand.label}: {row['state']}, {row['step_s'] * 1e3:.1f} ms/step "
                          f"(model {row['predicted_step_s'] * 1e3:.1f}), to target {row['to_target_s']} s "
                          f"at step {row['steps_to_target']} ({time.time() - began:.0f} s)", flush=True)
    ray.shutdown()
    return 0
