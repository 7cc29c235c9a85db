"""The convergence factors that `plan` and `sync.policy: auto` rank with (`orchestrator/convergence.json`),
computed from the network lab grid's result rows, without training anything.

A factor is a policy's steps to the target relative to BSP's, at 10 Gbit/s with no straggler (the grid's
`10g`/`none` cell), the median over the seeds run. The file holds one set of factors per learning rate and
world size measured; `orchestrator/planning/ranking.py` `load_factors` reads it and interpolates between
sets. This module also holds what a run's history says (time per step, bytes per step, time and steps to
the target), which the grid writes into each row. `python -m orchestrator calibrate` is the command;
`orchestrator/lab_grid.py` measures the rows. No Ray here.
"""
from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from core.schema import ConfigError
from orchestrator.planning.ranking import factor_sets, read_factor_file

LR, BATCH, WORKERS, PER_NODE = 0.1, 32, 4, 2
"""The grid's SGD rate, per-worker batch, world size and workers a lab node: a row that does not say its
rate or world size was measured at these."""
HIDDEN, TARGET = 512, 0.96
"""The grid's MLP width and held-out accuracy target, for rows that do not say theirs."""
BASE_CELL = ("10g", "none")
"""The cell the factors are counted in: 10 Gbit/s, no straggler (steps, not time, so the network matters little)."""
APPLIES_TO = {"workload": "orchestrator.workloads.digits", "optimizer": "sgd", "metric": "accuracy"}
TIMED_FROM_START = "start"
"""A row's `timed_from` once its time to the target counts from the start of training (`accuracy_evals`)."""
REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
"""Where a checkout keeps the grid's result rows (`tradeoffs*.jsonl`): `calibrate`'s default input."""


def per_step(history: list[dict]) -> float:
    """(t_last - t_10) / (steps after 10), the median over reporters (one for the lockstep kinds)."""
    by: dict[str, list[dict]] = {}
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
    by: dict[str, list[tuple[int, float]]] = {}
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
    record is its first commit (step 16 for `diloco h=16`), so timing from that record would leave its first
    round's steps out of its time to the target (a ninth of a 144-step run)."""
    start = run_start(history)
    return sorted((r["time"] - start, r["step"], r["metrics"]["accuracy"]) for r in history
                  if r.get("metrics", {}).get("accuracy") is not None)


def run_start(history: list[dict]) -> float:
    """When training began, on the records' clock: the first record's time less its step's worth of the
    run's time per step (`per_step`; the first record's time where there is none)."""
    first = min(history, key=lambda r: r["time"])
    pace = per_step(history)
    return first["time"] - first["step"] * (pace if pace == pace else 0.0)


def first_at(evals: list[tuple[float, int, float]], target: float) -> tuple[float | None, int | None]:
    """(seconds, step) of the first evaluation at or above `target`, or (None, None)."""
    return next(((t, s) for t, s, acc in evals if acc >= target), (None, None))


def from_start(row: dict, started: str | None = None) -> dict:
    """A row written before times to the target counted from the start of training, with its time to the
    target moved back by the steps before the first commit of the policy it started on (`started`, its own
    `policy` by default) at the run's time per step; the time as written is kept as `to_target_s_from_commit`.
    (On the grid's older rows, a periodic policy's time to the target equals its time per step times its
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


def load(path: Path, started: Callable[[dict], str] | None = None) -> list[dict]:
    """The rows of a result file, each timed to the target from the start of training (`from_start`;
    `started(row)`: the label of the policy a row's run started on, if not its `policy`); none when the
    file does not exist."""
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


def base_factors(medians: list[dict]) -> tuple[dict[str, float], int | None]:
    """({label: steps to the target relative to BSP}, BSP's steps) in the base cell of `by_seed`'s rows;
    no factors where BSP did not reach the target there."""
    base = [r for r in medians if (r["network"], r["condition"]) == BASE_CELL]
    bsp = next((r for r in base if r["policy"] == "bsp"), None)
    if not bsp or not bsp.get("steps_to_target"):
        return {}, None
    steps = bsp["steps_to_target"]
    return {r["policy"]: r["steps_to_target"] / steps for r in base if r.get("steps_to_target")}, steps


def seeds_text(seeds: int) -> str:
    return "one seed" if seeds == 1 else f"the median of {seeds} seeds"


def point_of(row: dict) -> tuple[float, int]:
    """(learning rate, world size) a row was measured at (the grid's where it does not say)."""
    return float(row.get("lr", LR)), int(row.get("workers", WORKERS))


def read_rows(paths: Sequence[Path]) -> list[tuple[str, dict]]:
    """(the file's name as the factors' source gives it, row) of every row in `paths`; ConfigError naming
    the file and line of what cannot be read."""
    found = []
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except OSError as err:
            raise ConfigError(f"calibrate: {path}: {err.strerror}") from None
        name = _shown(path)
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ConfigError(f"calibrate: {path}:{number}: not a JSON row (a lab grid result file holds one a line)") from None
            missing = [k for k in ("policy", "network", "condition", "steps_to_target") if not isinstance(row, dict) or k not in row]
            if missing:
                raise ConfigError(f"calibrate: {path}:{number}: not a lab grid row (no {', '.join(missing)})")
            found.append((name, from_start(row)))
    if not found:
        raise ConfigError(f"calibrate: no rows in {', '.join(map(str, paths)) or 'no files'}")
    return found


def _shown(path: Path) -> str:
    """A result file's name as a set's source gives it: relative to the checkout where it lies inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def factor_set(files: Sequence[str], rows: list[dict]) -> dict:
    """The set of factors `rows` (of one rate and world size, from `files`) measure, as the file stores it;
    ConfigError where BSP never reached the target in the base cell."""
    lr, workers = point_of(rows[0])
    medians = by_seed(rows)
    factors, bsp_steps = base_factors(medians)
    if not factors:
        raise ConfigError(f"calibrate: {', '.join(files)}: no BSP run reached the target at 10g/none (lr {lr:g}, "
                          f"{workers} workers): there is nothing to count the other policies' steps against")
    hidden, target = rows[0].get("hidden", HIDDEN), rows[0].get("target", TARGET)
    seeds = max(r["seeds"] for r in medians)
    return {"factors": factors, "bsp_steps": bsp_steps,
            "source": f"{', '.join(files)}: digits MLP ({hidden} hidden), {workers} workers, SGD lr {lr:g} momentum 0.9, "
                      f"steps to {target} held-out accuracy relative to BSP (10 Gbit/s, no straggler, {seeds_text(seeds)})",
            "measured_at": {"target": target, "lr": lr, "workers": workers, "global_batch": workers * BATCH}}


def calibrated(paths: Sequence[Path], current: dict) -> dict:
    """The convergence file's contents: `current`'s sets (a convergence.json's contents) with each rate and
    world size that `paths`' rows measure replaced by the set they give (the others kept), ordered by world
    size, then rate from the largest."""
    groups: dict[tuple[float, int], list[tuple[str, dict]]] = {}
    for name, row in read_rows(paths):
        groups.setdefault(point_of(row), []).append((name, row))
    fresh = [factor_set(list(dict.fromkeys(n for n, _ in group)), [r for _, r in group]) for group in groups.values()]

    def point(s: dict) -> tuple[float, int]:
        at = s["measured_at"]
        return float(at.get("lr") or 0), int(at.get("workers") or WORKERS)

    remeasured = {point(s) for s in fresh}
    kept = [s for s in factor_sets(current) if s["factors"] and not any(
        abs(point(s)[0] - lr) <= 1e-12 and point(s)[1] == w for lr, w in remeasured)]
    sets = sorted(kept + fresh, key=lambda s: (point(s)[1], -point(s)[0]))
    return {"applies_to": dict(APPLIES_TO), "sets": sets}


def file_text(contents: dict) -> str:
    """A convergence.json as it is written (one space of indent, a final newline)."""
    return json.dumps(contents, indent=1) + "\n"


def default_rows() -> list[Path]:
    """The grid's result files in this checkout (`benchmarks/results/tradeoffs*.jsonl`); ConfigError
    where there are none (an installed package has no benchmarks/)."""
    paths = sorted(RESULTS.glob("tradeoffs*.jsonl"))
    if not paths:
        raise ConfigError(f"calibrate: no result rows given and none in {RESULTS}: pass the lab grid's result "
                          "files, or measure them with --measure")
    return paths


def read_current(path: Path) -> dict:
    """`path`'s contents, or none where there is no such file; ConfigError where it is not a convergence file."""
    if not path.exists():
        return {}
    current = read_factor_file(path)
    if not isinstance(current, dict) or not current:
        raise ConfigError(f"calibrate: --out {path} is not a convergence file (JSON with \"sets\"): move it aside")
    return current
