"""Ranking the candidates: each one's predicted step time and bytes per step on a network (the runtime
model, algorithms/rules/runtime_model.py `predict`), its time to the target where a convergence factor applies
(`orchestrator/convergence.json`, written by `python -m orchestrator calibrate`), and the order that puts the
recommended policy first: an exact policy unless a relaxed one leads by more than the evidence's error."""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from algorithms.rules.runtime_model import INF, Compute, Network, predict
from core.schema import JobConfig
from orchestrator.planning.candidates import Candidate

FACTORS_PATH = Path(__file__).parent.parent / "convergence.json"


@dataclass(frozen=True)
class Row:
    candidate: Candidate
    step_s: float
    bytes_per_step: float
    factor: float | None
    """Steps to the target relative to BSP as ranked (the measured factor, below 1 only for a periodic
    policy credited with it: `rank`), or None where no factor applies."""
    to_target_s: float | None
    basis: str
    exact: bool = False
    """An exact policy: every step's update is the full-precision average of every member's gradients
    (BSP, flat or hierarchical); its steps to any target are BSP's by definition."""
    note: str = ""
    """Why the row has no time to the target ("convergence unknown for this workload")."""


EXACT = frozenset({"bsp", "bsp hierarchical"})
"""The candidates whose updates equal BSP's (hierarchical BSP sums in another order: the same up to float
rounding), so their convergence is BSP's whatever the workload."""
CREDITED = frozenset({"local_sgd", "diloco", "streaming_diloco"})
"""The policies whose factor below 1 `rank` credits where the factors were measured around the job's own
rate and world size (`load_factors`' `bracketed`). Each averages the replicas in rounds at set steps, so
its steps to a target are fixed by the workload, rate, world size and seed, not by timing or the network;
at a small rate DiLoCo's outer momentum really does reach the target in fewer steps than BSP (0.89 of
them over three seeds at lr 0.02). `shadow`'s steps depend on how long its background rounds take, so on
the network; a gossip policy's factor, credited where it was measured, ranked `dpsgd` first on a held-out
set where it was 1.4-2.2x the fastest (docs/tradeoffs.md, the third set). Both stay at 1 or more."""
RELAXED_MARGIN = 0.10
"""A relaxed policy is recommended over the best exact one only if its predicted time to the target is at
least this much lower: the factors come from a few seeds (over three seeds the same policy's factor
ranged 0.76-1.07) and the model's step times are within 25%, so a smaller lead is not evidence."""


def load_factors(path: Path = FACTORS_PATH, lr: float | None = None, workers: int | None = None) -> dict:
    """{"factors": {label: steps to the target relative to BSP}, "bsp_steps": BSP's steps to the target,
    "source": "...", "applies_to": {"workload": module, "optimizer": name, "metric": name},
    "measured_at": {"target": value, "lr": lr, "workers": n, "global_batch": samples a step},
    "bracketed": bool} as `orchestrator/calibration.py` wrote them; empty factors when none were measured.
    `measured_at` is the one setting `bsp_steps` counts (`bsp_steps_apply`).

    The file holds one such set per learning rate and world size it was measured at ("sets"; a file of one
    set without the list is read as one). A periodic or relaxed policy's steps relative to BSP's move with
    the rate (DiLoCo's outer momentum adds more at a small inner rate; local SGD drifts more at a large one)
    and with the number of replicas averaged, so a job at `lr` with `workers` gets the set measured at both;
    between two measured rates (of one world size), each factor interpolated linearly in log(rate), and
    BSP's steps in log-log; between two measured world sizes, the same in log(world size), each side taken
    at the job's rate first (the "source" says so; `measured_at` then names the two rates or sizes, and
    `bsp_steps_apply` holds for neither); outside them, the nearest. `bracketed` says whether the job's rate
    and world size were each measured or lie between two measured (`rank` credits a periodic policy with
    fewer steps than BSP only then). Without `lr`, the first set of the world size; without `workers`, the
    sets of the first set's world size; neither is bracketed."""
    raw = read_factor_file(path)
    sets = factor_sets(raw)
    scope = dict(raw.get("applies_to") or {})
    sized: dict[int, list[dict]] = {}
    for s in sets:
        if isinstance(s["measured_at"].get("workers"), int) and s["measured_at"]["workers"] > 0:
            sized.setdefault(s["measured_at"]["workers"], []).append(s)
    if not sized:  # the file does not say which world size its factors were counted at
        chosen = _at_rate(sets, lr)
        if workers is not None:
            chosen = {**chosen, "bracketed": False}
    elif workers is None:
        first = sets[0]["measured_at"].get("workers")
        chosen = {**_at_rate(sized.get(first) or sets, lr), "bracketed": False}
    else:  # (a set that does not say its world size is then left out)
        chosen = _at_size({w: _at_rate(group, lr) for w, group in sorted(sized.items())}, workers)
    return {**_described(chosen), "applies_to": scope}


def _described(chosen: dict) -> dict:
    """`chosen` with its "source" saying how its factors were had (`how`: interpolated, or the nearest) from
    which measured sets (`used`), and those two working keys dropped."""
    how, used = chosen.pop("how", []), chosen.pop("used", [])
    if not how:
        return chosen
    at = [f"lr {u['measured_at'].get('lr'):g}" + (f" with {u['measured_at']['workers']} workers" if u["measured_at"].get("workers") else "")
          for u in used if isinstance(u["measured_at"].get("lr"), (int, float))]
    points = list(dict.fromkeys(at))
    sets = f"; the sets measured at {', '.join(points)}" if len(points) > 1 else ""
    return {**chosen, "source": f"{'; '.join(dict.fromkeys(how))}{sets} ({'the first: ' if sets else ''}{chosen['source']})"}


def read_factor_file(path: Path = FACTORS_PATH) -> dict:
    """A convergence.json's contents; empty when there is none or it is not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def factor_sets(raw: dict) -> list[dict]:
    """The sets of factors in a convergence.json's contents, each with the keys `load_factors` returns but
    `applies_to` and `bracketed` (a file of one set without the list is read as one; an empty file as one
    empty set)."""
    return [_one_set(s) for s in (raw.get("sets") or [raw])]


def _one_set(data: dict) -> dict:
    return {"factors": {k: float(v) for k, v in data.get("factors", {}).items()},
            "bsp_steps": int(data.get("bsp_steps") or 0) or None, "source": str(data.get("source", "")),
            "measured_at": dict(data.get("measured_at") or {})}


def _between(lo: dict, hi: dict, w: float) -> tuple[dict[str, float], int | None]:
    """The factors a fraction `w` of the way from set `lo` to set `hi` (linear; those both sets have), and
    BSP's steps (linear in log)."""
    factors = {k: (1 - w) * v + w * hi["factors"][k] for k, v in lo["factors"].items() if k in hi["factors"]}
    steps = None
    if lo["bsp_steps"] and hi["bsp_steps"]:
        steps = round(math.exp((1 - w) * math.log(lo["bsp_steps"]) + w * math.log(hi["bsp_steps"])))
    return factors, steps


def _at_rate(sets: list[dict], lr: float | None) -> dict:
    """The factors for a job at `lr` from sets measured (at one world size) at several rates (`load_factors`)."""
    if lr is None or lr <= 0:
        return {**sets[0], "bracketed": False}
    rated = sorted((s for s in sets if isinstance(s["measured_at"].get("lr"), (int, float)) and s["measured_at"]["lr"] > 0),
                   key=lambda s: s["measured_at"]["lr"])
    if not rated:
        return {**sets[0], "bracketed": False}
    exact = [s for s in rated if _same(lr, s["measured_at"]["lr"])]
    if exact:
        return {**exact[0], "bracketed": True}
    below = [s for s in rated if s["measured_at"]["lr"] < lr]
    above = [s for s in rated if s["measured_at"]["lr"] > lr]
    if not below or not above:
        near = above[0] if not below else below[-1]
        rates = ", ".join(f"{s['measured_at']['lr']:g}" for s in rated)
        return {**near, "bracketed": False,
                "how": [*near.get("how", []), f"lr {lr:g} is outside the rates measured ({rates}): the nearest's"]}
    lo, hi = below[-1], above[0]
    a, b = lo["measured_at"]["lr"], hi["measured_at"]["lr"]
    factors, steps = _between(lo, hi, math.log(lr / a) / math.log(b / a))
    return {"factors": factors, "bsp_steps": steps, "bracketed": True, "source": lo["source"], "used": [lo, hi],
            "how": [f"interpolated in log(rate) at lr {lr:g} between lr {a:g} and {b:g}"],
            "measured_at": {**lo["measured_at"], "lr": None, "interpolated_between": [a, b]}}


def _at_size(per_size: dict[int, dict], workers: int) -> dict:
    """The factors for a job of `workers` replicas from the factors at its rate of each measured world size
    (`load_factors`)."""
    sizes = sorted(per_size)
    if workers in per_size:
        return per_size[workers]
    below = [n for n in sizes if n < workers]
    above = [n for n in sizes if n > workers]
    if not below or not above:
        near = per_size[above[0] if not below else below[-1]]
        return {**near, "bracketed": False,
                "how": [*near.get("how", []), f"{workers} workers is outside the world sizes measured "
                                              f"({', '.join(map(str, sizes))}): the nearest's"]}
    a, b = below[-1], above[0]
    lo, hi = per_size[a], per_size[b]
    factors, steps = _between(lo, hi, math.log(workers / a) / math.log(b / a))
    return {"factors": factors, "bsp_steps": steps, "bracketed": lo["bracketed"] and hi["bracketed"],
            "source": lo["source"], "used": [*lo.get("used", [lo]), *hi.get("used", [hi])],
            "how": [*lo.get("how", []), f"interpolated in log(world size) at {workers} workers between {a} and {b}"],
            "measured_at": {**lo["measured_at"], "workers": None, "global_batch": None, "workers_between": [a, b]}}


def factors_apply(cfg: JobConfig, data: dict) -> tuple[bool, str]:
    """(whether the convergence factors in `data` say anything about this job, and why not): they were
    measured on one workload family (the factory's module), optimizer and target metric, and are used
    only for a job with the same three."""
    if not data.get("factors") or not data.get("bsp_steps"):
        return False, "no convergence factors were measured"
    scope = data.get("applies_to") or {}
    if not scope:
        return False, "the convergence factors do not say what they were measured on"
    why = []
    family = cfg.workload.factory.split(":")[0]
    if family != scope.get("workload"):
        why.append(f"workload {family} (factors from {scope.get('workload')})")
    if cfg.optimizer.name != scope.get("optimizer"):
        why.append(f"optimizer {cfg.optimizer.name} (factors from {scope.get('optimizer')})")
    metric = cfg.stop.target.metric if cfg.stop.target is not None else None
    if metric != scope.get("metric"):
        why.append(f"target metric {metric or 'none'} (factors to a {scope.get('metric')} target)")
    return not why, "; ".join(why)


def bsp_steps_apply(cfg: JobConfig, data: dict) -> tuple[bool, str]:
    """(whether `data`'s `bsp_steps` say how many steps this job takes to its target, and why not). The
    factors are ratios and carry over to a job of the same workload family, optimizer and metric
    (`factors_apply`); BSP's count of steps is absolute, and holds only for the target value, learning
    rate and global batch it was measured at (a job at a fifth of the rate takes about twice the steps)."""
    at = data.get("measured_at") or {}
    if not at:
        return False, "the convergence factors do not say which target, rate and batch their BSP steps were counted at"
    if at.get("interpolated_between"):
        a, b = at["interpolated_between"]
        return False, f"lr {cfg.optimizer.lr:g} (BSP's steps were counted at lr {a:g} and {b:g}, not between)"
    if at.get("workers_between"):
        a, b = at["workers_between"]
        return False, f"{cfg.workers.count} workers (BSP's steps were counted with {a} and {b}, not between)"
    target = cfg.stop.target.value if cfg.stop.target is not None else None
    job: dict[str, float | None] = {"target": target, "lr": cfg.optimizer.lr,
                                    "global_batch": cfg.workers.count * cfg.workload.batch_size}
    off = [f"{k} {v} (counted at {at.get(k)})" for k, v in job.items() if v is None or not _same(v, at.get(k))]
    return not off, "; ".join(off)


def _same(value: float, counted: object) -> bool:
    return isinstance(counted, (int, float)) and abs(value - counted) <= 1e-9 * max(1.0, abs(counted))


def rank(cands: Sequence[Candidate], net: Network, compute: Compute, model_bytes: float,
         factors: dict[str, float] | None, bsp_steps: int | None = None, unknown: str = "",
         credit: bool = False) -> list[Row]:
    """Every candidate's prediction, the recommended one first.

    With `factors` (they apply to this job, `factors_apply`): time to the target is step time x BSP's
    steps x the factor, a relaxed policy's factor taken as at least 1 (it is not credited with
    converging faster than BSP: measured at another rate or world size, or for a policy whose steps
    depend on timing, a factor below 1 has ranked the wrong policy first), except a `CREDITED` periodic
    policy's where `credit` (the factors were measured around this job's rate and world size,
    `load_factors`' `bracketed`: `as_ranked`); a candidate without a factor gets none. The best exact
    policy is recommended unless a relaxed one's time to the target is at least RELAXED_MARGIN lower.
    Without factors (`unknown` says why): the exact policies by step time first,
    then the relaxed ones, shown by step time with "convergence unknown for this workload" and never
    recommended. On one node with no shaped link there is no network for a relaxed policy to save (its
    "savings" are copies between processes that share the node's cores and memory, which the model does
    not see), so the exact policy is recommended there too. Ties keep the candidates' order (exact
    policies first), never their names."""
    order = {c.label: i for i, c in enumerate(cands)}
    local = len(set(net.node_of_rank)) <= 1 and all(b == INF for row in net.bandwidth for b in row)
    rows = []
    for cand in cands:
        p = predict(cand.spec, net, compute, model_bytes)
        exact = cand.label in EXACT
        factor = None if factors is None else (1.0 if exact else factors.get(cand.label))
        if factor is not None and not exact:
            factor = as_ranked(str(cand.sync.get("policy", "")), factor, credit)
        to_target = p.step_s * bsp_steps * factor if factor is not None and bsp_steps else None
        note = "" if to_target is not None else ("convergence unknown for this workload" + (f": {unknown}" if unknown else ""))
        rows.append(Row(cand, p.step_s, p.bytes_per_step, factor, to_target, p.basis, exact, "" if exact else note))
    if local:
        rows = [r if r.exact else dataclasses.replace(r, note="one node: no network to save") for r in rows]
        return sorted(rows, key=lambda r: (not r.exact, r.to_target_s if r.to_target_s is not None else INF, r.step_s,
                                           order[r.candidate.label]))
    if factors is None or not bsp_steps:
        return sorted(rows, key=lambda r: (not r.exact, r.step_s, order[r.candidate.label]))
    known = sorted([r for r in rows if r.to_target_s is not None], key=lambda r: (r.to_target_s, order[r.candidate.label]))
    rest = sorted([r for r in rows if r.to_target_s is None], key=lambda r: (r.step_s, order[r.candidate.label]))
    exact_best = next((r for r in known if r.exact), None)
    if known and exact_best is not None and not known[0].exact \
            and _target_s(known[0]) > (1 - RELAXED_MARGIN) * _target_s(exact_best):
        known.remove(exact_best)
        known.insert(0, exact_best)  # the relaxed lead is within the evidence's error: the exact policy
    return known + rest


def as_ranked(policy: str, factor: float, credit: bool) -> float:
    """A relaxed policy's measured factor as `rank` counts it: at least 1, unless `credit` (the factors were
    measured around the job's rate and world size) and the policy is `CREDITED`."""
    return factor if credit and policy in CREDITED else max(factor, 1.0)


def _target_s(row: Row) -> float:
    """The time to the target of a row that has one."""
    if row.to_target_s is None:
        raise ValueError(f"{row.candidate.label} has no time to the target")
    return row.to_target_s
