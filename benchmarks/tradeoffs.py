"""Where each policy beats BSP: every policy `plan` weighs, on the network lab, at three networks and
three compute conditions, against the runtime model's prediction.

Setting (one cell = one network x one condition; every policy runs in every cell):
- 4 workers on 2 virtual nodes of the lab (w0, w1 on node 0; w2, w3 on node 1; `--workers N`: N on N/2
  nodes, 2 a node, to measure the factors at another world size), gloo on CPU; the
  links between the nodes shaped by the kernel (`tc` htb) at `10g` (10 Gbit/s, 0.05 ms modelled
  one-way latency), `1g` (1 Gbit/s, 0.2 ms) or `100m` (100 Mbit/s, 1 ms); within a node, loopback.
- The workload: the digits MLP with 2 hidden layers of `--hidden` units (512: 1.2 MB of float32
  parameters) and a modelled compute of `--compute-ms` per step, slept inside the forward pass
  (`orchestrator.workloads.digits:lab_mlp`; on 2 cores, 4 workers cannot show compute otherwise). The
  default, 15 ms, is about what the ring all-reduce of the gradients takes at 1 Gbit/s.
- Conditions: `none`; `straggler` (w1 computes 3x as long); `jitter` (every step's compute on every
  worker times a lognormal factor, sigma 0.5, median 1).
- SGD, lr 0.1, momentum 0.9, per-worker batch 32; target `--target` held-out accuracy (evaluated every
  5 steps), at most `--max-steps` steps (600). The decentralized policies run with `consensus_every: 0` (the
  consensus distance's two all-reduces are a global wait the model does not count).
- The server kinds are left out: their pushes and pulls travel on Ray's own transport, which the lab
  does not shape (see the README).

Per policy and cell: time per step (after step 10, (t_last - t_10) / steps, the median over the
members that report), bytes each worker sends per step (history's `bytes_sent`), time to the target
(from the first committed step to the first evaluation at or above it), steps to the target, and the
model's prediction of the time per step (`algorithms/rules/runtime_model.py`, fed the lab's links as
probed, one step's compute as the placed workers see it (a 100-step probe of the same 4 workers that
communicate once in 20 steps, `placed_compute`), of which the modelled sleep is what the cell's straggler or jitter
scales) with its error.
Then, per cell, the fastest policy to the target and what `plan` would have recommended (ranked with
the convergence factors this run measured at `none` on `10g`); the heat map of time to the target
relative to BSP (`--png`); one JSON line. Results are appended to `--out` as each policy finishes, so
a run that stops can be continued (`--resume`); `--report` re-prints from that file alone.

    python benchmarks/tradeoffs.py [--networks 10g,1g,100m] [--conditions none,straggler,jitter]
        [--only bsp,dpsgd] [--seeds 0,1,2] [--lr 0.1] [--workers 4] [--compute-ms 15] [--target 0.96] [--out tradeoffs.jsonl]
        [--resume] [--png docs/tradeoffs.png] [--write-factors] [--report] [--with benchmarks/results/tradeoffs_seeds.jsonl]

With several `--seeds`, each cell runs once per seed (the workload's initialization and the data order
change) and the tables take the medians (`by_seed`). `--with` adds the rows of other runs' files (other
seeds of the same cells) to the report and to the factors it writes; nothing runs for them.

Needs root and `tc` (the lab); exits 2 with the reason otherwise. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import functools
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NETWORKS = {"10g": (10000.0, 0.05), "1g": (1000.0, 0.2), "100m": (100.0, 1.0)}
CONDITIONS = ("none", "straggler", "jitter")
WORKERS, PER_NODE = 4, 2
"""The grid's world size (`--workers` measures the factors at another) and workers a lab node."""
LR, BATCH = 0.1, 32
"""The grid's SGD rate (`--lr` measures the factors at another) and per-worker batch (the factors' BSP
steps hold at these alone)."""


def job_dict(label: str, cand, network: str, condition: str, args, seed: int, root: str) -> dict:
    mbit, latency = NETWORKS[network]
    params = {"hidden": args.hidden, "depth": 2, "compute_ms": args.compute_ms, "seed": seed}
    if condition == "straggler":
        params["slow"] = {"w1": 3.0}
    elif condition == "jitter":
        params["jitter_sigma"] = 0.5
    sync = dict(cand.sync)
    if sync["policy"] in ("dpsgd", "dadam", "choco"):
        sync["consensus_every"] = 0
    name = "tradeoffs-" + "".join(ch if ch.isalnum() else "-" for ch in f"{label}-{network}-{condition}")
    return {"name": name[:64], "seed": seed, "run_dir": root,
            "workers": {"count": args.workers, "cpus": 0.5},
            "workload": {"factory": "orchestrator.workloads.digits:lab_mlp", "params": params, "batch_size": BATCH},
            "optimizer": {"name": "sgd", "lr": args.lr, "momentum": 0.9},
            "sync": sync, "compression": dict(cand.compression) or {"codec": "none"},
            "network": {"nodes": args.workers // PER_NODE, "workers_per_node": PER_NODE,
                        "inter": {"mbit": mbit, "latency_ms": latency}},
            "stop": {"max_steps": args.max_steps, "target": {"metric": "accuracy", "value": args.target}},
            "eval_every": 5}


def per_step(history: list[dict]) -> float:
    """(t_last - t_10) / (steps after 10), the median over reporters (one for the lockstep kinds)."""
    by = {}
    for r in history:
        by.setdefault(r.get("member", "rank0"), []).append(r)
    rates = []
    for records in by.values():
        records = sorted(records, key=lambda r: r["step"])
        after = [r for r in records if r["step"] >= 10]
        if len(after) >= 2 and after[-1]["step"] > after[0]["step"]:
            rates.append((after[-1]["time"] - after[0]["time"]) / (after[-1]["step"] - after[0]["step"]))
    return statistics.median(rates) if rates else float("nan")


def bytes_per_step(history: list[dict]) -> float:
    """What a reporter sent per step (history's `bytes_sent` is its running total), the median over reporters."""
    by = {}
    for r in history:
        if r.get("bytes_sent") is not None:
            by.setdefault(r.get("member", "rank0"), []).append((r["step"], r["bytes_sent"]))
    rates = []
    for points in by.values():
        points.sort()
        if len(points) >= 2 and points[-1][0] > points[0][0]:
            rates.append((points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0]))
    return statistics.median(rates) if rates else float("nan")


def accuracy_evals(history: list[dict]) -> list[tuple[float, int, float]]:
    """(seconds from the start of training, step, held-out accuracy) of each evaluation, in order. The start
    is the first record's time less its step's worth of the run's time per step: a periodic policy's first
    record is its first commit (step 16 for `diloco h=16`), so timing from that record, as this did before
    2026-11-29, left its first round's steps out of its time to the target (a ninth of a 144-step run)."""
    start = run_start(history)
    return sorted((r["time"] - start, r["step"], r["metrics"]["accuracy"]) for r in history
                  if r.get("metrics", {}).get("accuracy") is not None)


def run_start(history: list[dict]) -> float:
    """When training began, on the records' clock: the first record's time less its step's worth of the
    run's time per step (`per_step`; the first record's time where there is none)."""
    first = min(history, key=lambda r: r["time"])
    pace = per_step(history)
    return first["time"] - first["step"] * (pace if pace == pace else 0.0)


TIMED_FROM_START = "start"
"""A row's `timed_from` once its time to the target counts from the start of training (`accuracy_evals`)."""


def from_start(row: dict, started: str | None = None) -> dict:
    """A row written before times to the target counted from the start of training, with its time to the
    target moved back by the steps before the first commit of the policy it started on (`started`, its own
    `policy` by default) at the run's time per step; the time as written is kept as `to_target_s_from_commit`.
    (On the rows of 2026-11-28, a periodic policy's time to the target equals its time per step times its
    steps to the target less its first commit's step, to within 1%.)"""
    if row.get("timed_from") == TIMED_FROM_START or not row.get("step_s"):
        return row
    gap = first_commit(started or row["policy"])
    if gap is None:
        return row
    shift = gap * row["step_s"]
    moved = {**row, "timed_from": TIMED_FROM_START, "to_target_s_from_commit": row.get("to_target_s")}
    for key in ("to_target_s", "to_within_2pct_s"):  # the latter and the curve: benchmarks/lm_lab.py's rows
        if row.get(key) is not None:
            moved[key] = row[key] + shift
    if row.get("curve"):
        moved["curve"] = [[t + shift, *rest] for t, *rest in row["curve"]]
    return moved


def first_commit(label: str) -> int | None:
    """The step of a candidate's first committed record: 1 for a synchronous kind, h for a periodic round,
    h / fragments plus the overlap for streaming DiLoCo (`planner.commit_gap`); None for a label no
    candidate has."""
    return _commit_gaps().get(label)


@functools.cache
def _commit_gaps() -> dict[str, int]:
    """`planner.commit_gap` of every candidate `plan` weighs, SGD's and AdamW's, by label."""
    from orchestrator import planner
    from orchestrator.config import config_from_dict

    gaps: dict[str, int] = {}
    for opt in ({"name": "sgd", "lr": 0.1}, {"name": "adamw", "lr": 0.003}):
        cfg = config_from_dict({"name": "x", "workers": {"count": 4}, "optimizer": opt,
                                "workload": {"factory": "orchestrator.workloads.digits:mlp"},
                                "network": {"nodes": 2, "workers_per_node": 2}})
        gaps.update({c.label: planner.commit_gap(c.spec) for c in planner.candidates(cfg)})
    return gaps


def first_at(evals: list[tuple[float, int, float]], target: float) -> tuple[float | None, int | None]:
    """(seconds, step) of the first evaluation at or above `target`, or (None, None)."""
    return next(((t, s) for t, s, acc in evals if acc >= target), (None, None))


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


def run_cell(label, cand, network, condition, args, root, seed: int = 0) -> dict:
    from orchestrator.config import config_from_dict
    from orchestrator.job import ElasticJob

    job = ElasticJob(config_from_dict(job_dict(label, cand, network, condition, args, seed, root))).start()
    result = job.wait(timeout=1200)
    history = job.history()
    if not history:
        raise RuntimeError(f"{label} {network} {condition}: no history ({result.state}: {result.cause})")
    evals = accuracy_evals(history)
    hit = first_at(evals, args.target)
    return {"policy": label, "network": network, "condition": condition, "seed": seed, "lr": args.lr,
            "workers": args.workers, "state": result.state,
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


def placed_compute(args, root: str) -> float:
    """The compute time of one step as the placed workers see it (the probe's measurement): the same
    workers, workload, evaluation cadence and CPU contention, communicating once in 20 steps (`local_sgd`,
    h 20, unshaped: a round on loopback adds well under 1 ms a step); time per step after step 10."""
    from algorithms.rules.runtime_model import PolicySpec
    from orchestrator.planner import Candidate

    quiet = Candidate("calibration", {"policy": "local_sgd", "h": 20}, {}, PolicySpec("local_sgd"))
    return placed_step_s(job_dict("calibration", quiet, "10g", "none", args, 0, root), 100)


def predict_cell(cand, network: str, condition: str, probed: list[dict], step_s: float, modelled_s: float,
                 model_bytes: float, host_s=None, workers: int = WORKERS) -> float:
    from algorithms.rules.runtime_model import predict

    return predict(cand.spec, cell_network(network, probed, host_s, workers),
                   cell_compute(condition, step_s, modelled_s), model_bytes).step_s


def load(path: Path, started=None) -> list[dict]:
    """The rows of a result file, each timed to the target from the start of training (`from_start`;
    `started(row)`: the label of the policy a row's run started on, if not its `policy`)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [from_start(r, started(r) if started else None) for r in rows]


def by_seed(rows: list[dict]) -> list[dict]:
    """One row per (policy, network, condition): with several seeds, the medians of the time per step,
    the bytes per step and, over the seeds that reached the target, the time and steps to it (a cell
    whose target most seeds missed counts as missed); `seeds` says how many."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["policy"], r["network"], r["condition"]), []).append(r)
    out = []
    for group in cells.values():
        row = dict(group[0])
        row["seeds"] = len(group)
        if len(group) > 1:
            row["step_s"] = statistics.median(r["step_s"] for r in group)
            row["bytes_per_step"] = statistics.median(r["bytes_per_step"] for r in group)
            reached = [r for r in group if r.get("to_target_s") is not None]
            if 2 * len(reached) > len(group):
                row["to_target_s"] = statistics.median(r["to_target_s"] for r in reached)
                row["steps_to_target"] = statistics.median(r["steps_to_target"] for r in reached)
            else:
                row["to_target_s"] = row["steps_to_target"] = None
        out.append(row)
    return out


def report(rows: list[dict], args) -> dict:
    """The tables, the fastest policy and `plan`'s pick per cell, the heat map; returns the JSON summary."""
    from orchestrator import planner
    from orchestrator.config import config_from_dict

    rows = by_seed(rows)
    seeds = max(r["seeds"] for r in rows)
    workers = row_workers(rows)
    if seeds > 1:
        print(f"medians over up to {seeds} seeds a cell")

    cells = [(n, c) for n in NETWORKS for c in CONDITIONS if any(r["network"] == n and r["condition"] == c for r in rows)]
    by_label = {c.label: c for c in planner.candidates(config_from_dict({
        "name": "x", "workers": {"count": workers}, "workload": {"factory": "orchestrator.workloads.digits:mlp"},
        "network": {"nodes": workers // PER_NODE, "workers_per_node": PER_NODE}}))}
    for r in rows:  # the model's prediction, again from the measured inputs kept with each row
        r["predicted_step_s"] = predict_cell(by_label[r["policy"]], r["network"], r["condition"], r["probed"],
                                             r["compute_s"], r["modelled_s"], r["model_bytes"], r.get("host_s"), workers)
    get = {(r["policy"], r["network"], r["condition"]): r for r in rows}
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    base = [r for r in rows if r["network"] == "10g" and r["condition"] == "none"]
    bsp_base = get.get(("bsp", "10g", "none"))
    factors = {}
    if bsp_base and bsp_base.get("steps_to_target"):
        factors = {r["policy"]: r["steps_to_target"] / bsp_base["steps_to_target"] for r in base if r.get("steps_to_target")}
    worst = (0.0, None)
    summary_cells = {}
    for network, condition in cells:
        print(f"\n== {network}, {condition}")
        print(f"{'policy':<28}{'ms/step':>9}{'model':>9}{'err':>7}{'MB/step':>9}{'to target s':>13}{'steps':>7}{'vs bsp':>8}")
        bsp = get.get(("bsp", network, condition))
        cell = {}
        for p in policies:
            r = get.get((p, network, condition))
            if r is None:
                continue
            err = (r["predicted_step_s"] - r["step_s"]) / r["step_s"] if r["step_s"] == r["step_s"] else float("nan")
            if abs(err) > abs(worst[0]):
                worst = (err, f"{p} at {network}/{condition}")
            ratio = (r["to_target_s"] / bsp["to_target_s"]) if bsp and bsp.get("to_target_s") and r.get("to_target_s") else None
            cell[p] = {"step_s": r["step_s"], "predicted_step_s": r["predicted_step_s"], "error": err,
                       "bytes_per_step": r["bytes_per_step"], "to_target_s": r["to_target_s"], "vs_bsp": ratio,
                       "step_vs_bsp": r["step_s"] / bsp["step_s"] if bsp else None}
            target = f"{r['to_target_s']:.1f}" if r.get("to_target_s") is not None else "missed"
            print(f"{p:<28}{r['step_s'] * 1e3:>9.1f}{r['predicted_step_s'] * 1e3:>9.1f}{err:>+7.0%}"
                  f"{r['bytes_per_step'] / 1e6:>9.3f}{target:>13}{str(r.get('steps_to_target') or '-'):>7}"
                  f"{(f'{ratio:.2f}' if ratio else '-'):>8}")
        reached = {p: v["to_target_s"] for p, v in cell.items() if v["to_target_s"] is not None}
        fastest = min(reached, key=reached.get) if reached else None
        pick = None
        if factors and rows[0].get("model_bytes"):
            cands = [c for label, c in by_label.items() if label in cell and label in factors]
            # the inputs measured with this cell's rows (a resumed run measures them again for the rows it adds)
            measured = next(r for r in rows if r["network"] == network and r["condition"] == condition)
            net = cell_network(network, measured["probed"], measured.get("host_s"), workers)
            compute = cell_compute(condition, measured["compute_s"], measured["modelled_s"])
            ranked = planner.rank(cands, net, compute, measured["model_bytes"], factors, bsp_base["steps_to_target"],
                                  credit=True)  # measured at this cell's own rate and world size
            pick = ranked[0].candidate.label
        good = bool(fastest and pick and reached.get(pick) is not None and reached[pick] <= 1.10 * reached[fastest])
        print(f"fastest to the target: {fastest} ({reached.get(fastest, float('nan')):.1f} s); plan's pick: {pick}"
              f"{' (within 10%)' if good else ''}")
        summary_cells[f"{network}/{condition}"] = {"fastest": fastest, "plan": pick, "plan_within_10pct": good,
                                                   "policies": cell}
    if args.markdown:
        markdown(summary_cells, policies)
    picks_good = [v["plan_within_10pct"] for v in summary_cells.values() if v["plan"]]
    print(f"\nmodel error: worst {worst[0]:+.0%} ({worst[1]}); plan within 10% of the fastest in "
          f"{sum(picks_good)} of {len(picks_good)} cells")
    if args.png:
        heat_map(summary_cells, policies, Path(args.png))
    return {"benchmark": "tradeoffs", "compute_ms": args.compute_ms, "target": args.target, "hidden": args.hidden,
            "seeds": seeds, "workers": workers,
            "factors": factors, "bsp_steps": bsp_base and bsp_base.get("steps_to_target"),
            "worst_model_error": worst[0], "worst_model_cell": worst[1],
            "plan_within_10pct": f"{sum(picks_good)}/{len(picks_good)}", "cells": summary_cells}


def row_workers(rows: list[dict]) -> int:
    """The world size the rows were measured at (rows written before `--workers` are the grid's)."""
    return int(rows[0].get("workers", WORKERS)) if rows else WORKERS


def seeds_text(seeds: int) -> str:
    return "one seed" if seeds == 1 else f"the median of {seeds} seeds"


def markdown(cells: dict, policies: list[str]) -> None:
    """The README's tables: time to the target relative to BSP, and time per step measured (model)."""
    names = list(cells)
    head = "| policy | " + " | ".join(names) + " |\n|---|" + "---|" * len(names)
    print("\ntime to the target, relative to BSP in the same cell (BSP's seconds in its row):\n" + head)
    for p in policies:
        row = []
        for cell in names:
            v = cells[cell]["policies"].get(p)
            if v is None:
                row.append("")
            elif p == "bsp":
                row.append(f"{v['to_target_s']:.1f} s" if v["to_target_s"] is not None else "missed")
            else:
                row.append(f"{v['vs_bsp']:.2f}" if v["vs_bsp"] is not None else "missed")
            if v is not None and cells[cell]["fastest"] == p:
                row[-1] = f"**{row[-1]}**"
        print(f"| {p} | " + " | ".join(row) + " |")
    print("\ntime per step in ms, measured (the model's prediction):\n" + head)
    for p in policies:
        row = [f"{v['step_s'] * 1e3:.1f} ({v['predicted_step_s'] * 1e3:.1f})" if (v := cells[c]["policies"].get(p)) else ""
               for c in names]
        print(f"| {p} | " + " | ".join(row) + " |")


def heat_map(cells: dict, policies: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): no heat map")
        return
    import numpy as np

    names = list(cells)
    grid = np.full((len(policies), len(names)), np.nan)
    for j, cell in enumerate(names):
        for i, p in enumerate(policies):
            v = cells[cell]["policies"].get(p, {}).get("vs_bsp")
            grid[i, j] = v if v is not None else np.nan
    fig, ax = plt.subplots(figsize=(1.1 * len(names) + 3, 0.45 * len(policies) + 1.8))
    im = ax.imshow(np.log2(grid), cmap="RdYlGn_r", vmin=-2, vmax=2, aspect="auto")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
    ax.set_yticks(range(len(policies)), policies)
    for i in range(len(policies)):
        for j in range(len(names)):
            ax.text(j, i, "missed" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_title("time to the target accuracy, relative to BSP in the same cell (lower is better)")
    fig.colorbar(im, ax=ax, label="log2 ratio")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"heat map: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default="10g,1g,100m")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--only", default="", help="comma-separated plan labels or policy names")
    parser.add_argument("--compute-ms", type=float, default=15.0)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--target", type=float, default=0.96)
    parser.add_argument("--lr", type=float, default=LR, help="the SGD rate of every run (the factors are written as measured at it)")
    parser.add_argument("--workers", type=int, default=WORKERS,
                        help=f"workers, {PER_NODE} a lab node (the factors are written as measured at this world size)")
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds: each cell runs once per seed (medians)")
    parser.add_argument("--out", default="tradeoffs.jsonl")
    parser.add_argument("--resume", action="store_true", help="skip the cells already in --out")
    parser.add_argument("--report", action="store_true", help="only print the report from --out")
    parser.add_argument("--with", dest="with_", default="",
                        help="comma-separated result files of other seeds whose rows join --out's in the report")
    parser.add_argument("--png", default=None)
    parser.add_argument("--markdown", action="store_true", help="also print the README's tables")
    parser.add_argument("--write-factors", action="store_true",
                        help="write the measured convergence factors to orchestrator/convergence.json for plan and auto")
    args = parser.parse_args()
    if args.workers < PER_NODE or args.workers % PER_NODE:
        print(f"--workers: {args.workers} is not a positive multiple of {PER_NODE} (the lab puts {PER_NODE} on a node)",
              file=sys.stderr)
        return 2
    rows = measured_rows(args, Path(args.out), measure)
    if isinstance(rows, int):
        return rows
    for extra in filter(None, args.with_.split(",")):
        if not Path(extra).exists():
            print(f"--with: no such file: {extra}", file=sys.stderr)
            return 2
        rows += load(Path(extra))
    rates = sorted({float(r.get("lr", LR)) for r in rows})
    if args.write_factors and rates != [args.lr]:
        print(f"--write-factors: the rows were measured at lr {', '.join(f'{x:g}' for x in rates)}, not --lr {args.lr:g} "
              f"alone (rows without a rate are the grid's, {LR:g})", file=sys.stderr)
        return 2
    sizes = sorted({int(r.get("workers", WORKERS)) for r in rows})
    if len(sizes) > 1 or (args.write_factors and sizes != [args.workers]):
        print(f"the rows were measured with {', '.join(map(str, sizes))} workers; one world size a report"
              + (f", and --write-factors needs --workers {args.workers}'s alone" if args.write_factors else "")
              + f" (rows without one are the grid's, {WORKERS})", file=sys.stderr)
        return 2
    summary = report(rows, args)
    if args.write_factors and summary["factors"]:
        write_factors(summary, args)
        print("wrote orchestrator/convergence.json")
    print(json.dumps(summary))
    return 0


def write_factors(summary: dict, args) -> None:
    """This run's factors into orchestrator/convergence.json as the set measured at `--lr`: it replaces a set
    measured at the same rate and keeps the others (a job between two measured rates gets the factors
    interpolated between them: orchestrator/planning/ranking.py `load_factors`)."""
    from orchestrator.planning.ranking import factor_sets, read_factor_file

    path = REPO / "orchestrator" / "convergence.json"
    def same_point(at: dict) -> bool:
        return (isinstance(at.get("lr"), (int, float)) and abs(at["lr"] - args.lr) <= 1e-12
                and int(at.get("workers") or WORKERS) == args.workers)

    sets = [s for s in factor_sets(read_factor_file(path)) if s["factors"] and not same_point(s["measured_at"])]
    sets.append({"factors": summary["factors"], "bsp_steps": summary["bsp_steps"],
                 "source": f"benchmarks/tradeoffs.py, {time.strftime('%Y-%m-%d')}: digits MLP ({args.hidden} hidden), "
                           f"{args.workers} workers, SGD lr {args.lr:g} momentum 0.9, steps to {args.target} held-out "
                           f"accuracy relative to BSP (10 Gbit/s, no straggler, {seeds_text(summary['seeds'])})",
                 "measured_at": {"target": args.target, "lr": args.lr, "workers": args.workers,
                                 "global_batch": args.workers * BATCH}})
    sets.sort(key=lambda s: (int(s["measured_at"].get("workers") or WORKERS), -float(s["measured_at"].get("lr") or 0)))
    path.write_text(json.dumps({
        "applies_to": {"workload": "orchestrator.workloads.digits", "optimizer": "sgd", "metric": "accuracy"},
        "sets": sets}, indent=1) + "\n")


def measured_rows(args, out: Path, measure) -> list[dict] | int:
    """The rows in `out`, after `measure(args, out)` adds to them (unless `--report`); an exit code where
    measuring failed or there are none."""
    if not args.report:
        code = measure(args, out)
        if code:
            return code
    rows = load(out)
    if not rows:
        print(f"no results in {out}")
        return 1
    return rows


def lab_ready() -> bool:
    """Whether the lab can run here (root and `tc`; else the reason on stderr); a SIGTERM then unwinds
    the process, so the lab comes down on a kill too."""
    from orchestrator import lab

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        lab.check_privileges()
    except lab.LabUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return False
    return True


def measure(args, out: Path) -> int:
    import ray

    from orchestrator import lab, planner
    from orchestrator.config import config_from_dict
    from orchestrator.job import NAMESPACE, ensure_token_env

    if not lab_ready():
        return 2
    done = {(r["policy"], r["network"], r["condition"], r.get("seed", 0)) for r in load(out)} if args.resume else set()
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    if not args.resume:
        out.write_text("")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    base = config_from_dict({"name": "x", "workers": {"count": args.workers},
                             "workload": {"factory": "orchestrator.workloads.digits:mlp"},
                             "network": {"nodes": args.workers // PER_NODE, "workers_per_node": PER_NODE}})
    cands = [c for c in planner.candidates(base) if not only or c.label in only or c.sync["policy"] in only]
    measured = config_from_dict(job_dict("bsp", cands[0], "10g", "none", args, 0, "/tmp"))
    alone_s, model_bytes = planner.measure_compute(measured)
    ensure_token_env()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False, logging_level="ERROR")
    root = tempfile.mkdtemp(prefix="tradeoffs-")
    compute_s, modelled_s = placed_compute(args, root), args.compute_ms / 1e3
    host_s = planner.measure_host(measured, cands, model_bytes)
    print(f"one step's compute: {alone_s * 1e3:.2f} ms in one process, {compute_s * 1e3:.2f} ms among the {args.workers} "
          f"placed workers (modelled sleep {args.compute_ms} ms of it); model {model_bytes / 1e6:.3f} MB; each pattern's "
          f"synchronization among {args.workers} ranks on this machine: "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(host_s.items())), flush=True)
    for network in [n.strip() for n in args.networks.split(",") if n.strip()]:
        net_cfg = config_from_dict(job_dict("bsp", cands[0], network, "none", args, 0, root)).network
        with lab.Lab(net_cfg):
            probed = lab.probe(net_cfg)
            for row in probed:
                print(f"[{network}] link {row['a']}->{row['b']}: asked {row['asked_mbit'] or 'unshaped'} Mbit/s, "
                      f"measured {row['measured_mbit']:.0f}, rtt {row['rtt_ms']:.3f} ms", flush=True)
            for condition in [c.strip() for c in args.conditions.split(",") if c.strip()]:
                for cand, seed in [(c, s) for s in seeds for c in cands]:
                    if (cand.label, network, condition, seed) in done:
                        continue
                    began = time.time()
                    row = run_cell(cand.label, cand, network, condition, args, root, seed)
                    row.update(predicted_step_s=predict_cell(cand, network, condition, probed, compute_s, modelled_s,
                                                             model_bytes, host_s, args.workers),
                               compute_s=compute_s, modelled_s=modelled_s, model_bytes=model_bytes, probed=probed,
                               host_s=host_s)
                    with open(out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"[{network}/{condition}, seed {seed}] {cand.label}: {row['state']}, {row['step_s'] * 1e3:.1f} ms/step "
                          f"(model {row['predicted_step_s'] * 1e3:.1f}), to target {row['to_target_s']} s "
                          f"at step {row['steps_to_target']} ({time.time() - began:.0f} s)", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
