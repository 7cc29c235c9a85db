"""Where each policy beats BSP: every policy `plan` weighs, on the network lab, at three networks and
three compute conditions, against the runtime model's prediction.

The grid itself (the setting, each cell's job, what a row holds) is `orchestrator/lab_grid.py`; this
script runs it and reports it. The server kinds are left out: their pushes and pulls travel on Ray's own
transport, which the lab does not shape.

Per policy and cell: time per step (after step 10, (t_last - t_10) / steps, the median over the
members that report), bytes each worker sends per step (history's `bytes_sent`), time to the target
(from the start of training to the first evaluation at or above it), steps to the target, and the
model's prediction of the time per step (`algorithms/rules/runtime_model.py`, fed the lab's links as
probed, one step's compute as the placed workers see it (a 100-step probe of the same workers that
communicate once in 20 steps, `placed_compute`), of which the modelled sleep is what the cell's straggler or jitter
scales) with its error.
Then, per cell, the fastest policy to the target and what `plan` would have recommended (ranked with
the convergence factors this run measured at `none` on `10g`); the heat map of time to the target
relative to BSP (`--png`); one JSON line. Results are appended to `--out` as each policy finishes, so
a run that stops can be continued (`--resume`); `--report` re-prints from that file alone.

    python benchmarks/tradeoffs.py [--networks 10g,1g,100m] [--conditions none,straggler,jitter]
        [--only bsp,dpsgd] [--seeds 0,1,2] [--lr 0.1] [--workers 4] [--compute-ms 15] [--target 0.96] [--out tradeoffs.jsonl]
        [--resume] [--png docs/tradeoffs.png] [--report] [--with benchmarks/results/tradeoffs_seeds.jsonl]

With several `--seeds`, each cell runs once per seed (the workload's initialization and the data order
change) and the tables take the medians (`by_seed`). `--with` adds the rows of other runs' files (other
seeds of the same cells) to the report; nothing runs for them. The convergence factors that `plan` and
`auto` use are written from such files by `python -m orchestrator calibrate` (docs/lab.md).

Needs root and `tc` (the lab); exits 2 with the reason otherwise. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from core.schema import ConfigError  # noqa: E402
from orchestrator.calibration import LR, PER_NODE, WORKERS, base_factors, by_seed, load  # noqa: E402
from orchestrator.lab_grid import CONDITIONS, NETWORKS, Grid, cell_compute, cell_network, measure, predict_cell  # noqa: E402


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
    factors, bsp_steps = base_factors(rows)
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
            ranked = planner.rank(cands, net, compute, measured["model_bytes"], factors, bsp_steps,
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
            "factors": factors, "bsp_steps": bsp_steps,
            "worst_model_error": worst[0], "worst_model_cell": worst[1],
            "plan_within_10pct": f"{sum(picks_good)}/{len(picks_good)}", "cells": summary_cells}


def row_workers(rows: list[dict]) -> int:
    """The world size the rows were measured at (rows written before `--workers` are the grid's)."""
    return int(rows[0].get("workers", WORKERS)) if rows else WORKERS


def markdown(cells: dict, policies: list[str]) -> None:
    """The tables as markdown: time to the target relative to BSP, and time per step measured (model)."""
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


def words(text: str) -> tuple[str, ...]:
    """A comma-separated option's items."""
    return tuple(w.strip() for w in text.split(",") if w.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default="10g,1g,100m")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--only", default="", help="comma-separated plan labels or policy names")
    parser.add_argument("--compute-ms", type=float, default=15.0)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--target", type=float, default=0.96)
    parser.add_argument("--lr", type=float, default=LR, help="the SGD rate of every run")
    parser.add_argument("--workers", type=int, default=WORKERS,
                        help=f"workers, {PER_NODE} a lab node")
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds: each cell runs once per seed (medians)")
    parser.add_argument("--out", default="tradeoffs.jsonl")
    parser.add_argument("--resume", action="store_true", help="skip the cells already in --out")
    parser.add_argument("--report", action="store_true", help="only print the report from --out")
    parser.add_argument("--with", dest="with_", default="",
                        help="comma-separated result files of other seeds whose rows join --out's in the report")
    parser.add_argument("--png", default=None)
    parser.add_argument("--markdown", action="store_true", help="also print the tables as markdown (docs/tradeoffs.md)")
    args = parser.parse_args()
    try:
        grid = Grid(networks=words(args.networks), conditions=words(args.conditions), only=frozenset(words(args.only)),
                    seeds=tuple(int(x) for x in words(args.seeds)), lr=args.lr, workers=args.workers,
                    compute_ms=args.compute_ms, hidden=args.hidden, target=args.target, max_steps=args.max_steps,
                    resume=args.resume)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    rows = measured_rows(args, Path(args.out), lambda _, out: measure(grid, out))
    if isinstance(rows, int):
        return rows
    for extra in filter(None, args.with_.split(",")):
        if not Path(extra).exists():
            print(f"--with: no such file: {extra}", file=sys.stderr)
            return 2
        rows += load(Path(extra))
    sizes = sorted({int(r.get("workers", WORKERS)) for r in rows})
    if len(sizes) > 1:
        print(f"the rows were measured with {', '.join(map(str, sizes))} workers; one world size a report"
              f" (rows without one are the grid's, {WORKERS})", file=sys.stderr)
        return 2
    summary = report(rows, args)
    print(json.dumps(summary))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
