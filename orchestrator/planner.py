"""Choosing a policy: every applicable policy's predicted time per step, bytes per step and time to
the target on a network, from the runtime model (algorithms/rules/runtime_model.py), and a recommendation.

The inputs are a job config (its workload, optimizer, world size and stragglers), a network (the
`network:` section as asked, or the lab's links as probed) and the compute time of one step, measured
here on the workload (`measure_compute`). Time to the target multiplies the predicted step time by
the steps BSP needs and the policy's convergence factor (steps to the target relative to BSP), where
one was measured (`orchestrator/convergence.json`, written by `python -m orchestrator calibrate` from the lab
grid's result rows, which it names); without a factor a policy is ranked by its step time and the table says so.

`python -m orchestrator plan CONFIG [--network FILE | --probe]` prints the table; `sync.policy: auto`
resolves through `choose` before the job starts (`ElasticJob.start`), and the job's first event says
what was picked and why.

This module is that entry (`ranked`, `choose`, `resumed_choice`, the online trial's shortlist) and the
one place callers import from; the parts live in `orchestrator/planning/`: the candidates
(`candidates.py`), the network and compute the model predicts on (`cluster.py`), what is timed on this
machine (`measure.py`), the ranking and the convergence factors (`ranking.py`), the printed report
(`report.py`).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path

from actors.plan import turn_steps
from algorithms.rules.runtime_model import PolicySpec
from core.schema import POLICIES, ConfigError, JobConfig, parse
from orchestrator.planning.candidates import Candidate, candidates, with_candidate, with_layout
from orchestrator.planning.cluster import (
    compute_from_probe,
    compute_spread,
    network_for,
    network_from_probe,
    probed_compute_s,
    rank_medians,
    told_network,
)
from orchestrator.planning.measure import measure_compute, measure_host, parameter_layout
from orchestrator.planning.ranking import (
    CREDITED,
    EXACT,
    FACTORS_PATH,
    RELAXED_MARGIN,
    Row,
    bsp_steps_apply,
    factors_apply,
    load_factors,
    rank,
)
from orchestrator.planning.report import describe_probe, recommendation, table

__all__ = [  # the names callers reach through this module (the CLI, benchmarks, tests)
    "CREDITED", "EXACT", "FACTORS_PATH", "RELAXED_MARGIN", "SWITCHABLE", "Candidate", "PolicySpec", "Row", "bsp_steps_apply",
    "candidates", "candidates_on", "choose", "compute_from_probe", "compute_spread", "describe_probe", "factors_apply",
    "factors_line", "job_factors", "load_factors", "measure_compute", "measure_host", "network_for", "network_from_probe",
    "probed_compute_s", "rank", "rank_medians", "ranked", "recommendation", "refuse_resume", "resumed_choice",
    "shortlist", "table", "told_network", "with_candidate",
]

SWITCHABLE = frozenset(row.name for row in POLICIES if row.switchable)
"""The policies an online trial (`sync.auto`) may switch between mid-run (the policy table's
`switchable`): each holds BSP's replicated state at its commit points (the same parameters on every
member after a step or a round), so a switch at one loses and repeats no sample. Streaming DiLoCo's
members differ at a commit point by design (its fragments merge at different steps): before they leave
it they synchronize every fragment at once, as at the end of a run (actors/training/replica.py
`_flush_for_switch`). The inner optimizer's state of the periodic ones is each member's own: at a switch
every member takes rank 0's."""


def candidates_on(cfg: JobConfig, cluster: dict | None) -> list[Candidate]:
    """`candidates` for the nodes the ranks run on: those the probes landed on (`cluster`), unless the
    config tells the cluster's network (then its nodes), else the lab's."""
    return candidates(cfg, len(cluster["nodes"]) if cluster is not None and not told_network(cfg) else None)


def ranked(cfg: JobConfig, cands: Sequence[Candidate], compute_s: float, model_bytes: float,
           probed: Sequence[dict] | None = None, host_s: dict[str, float] | None = None,
           cluster: dict | None = None) -> list[Row]:
    """`rank` on the job's own network (as asked, or `probed`) and stragglers, with the shipped
    convergence factors: what `plan` prints and `auto` picks from. In the lab, whose nodes share this
    machine, each synchronization pattern's host time is this machine's (`host_s`, measured here by
    `measure_host` when not given); elsewhere none is counted."""
    data = job_factors(cfg)
    applies, why = factors_apply(cfg, data)
    if cluster is not None:  # measured on the user's cluster (actors/training/probe.py); its links as told, if they were
        net = network_for(cfg.network, cfg.workers.count) if told_network(cfg) else network_from_probe(cluster)
        return rank(cands, net, compute_from_probe(cfg, cluster, compute_s), cluster["model_bytes"],
                    data["factors"] if applies else None, data["bsp_steps"], why, data.get("bracketed", False))
    layout = parameter_layout(cfg)
    cands = with_layout(cands, layout, cfg.network.lab)
    if host_s is None and cfg.network.lab:
        host_s = measure_host(cfg, cands, model_bytes, layout=layout)
    net = network_for(cfg.network, cfg.workers.count, probed, host_s)
    return rank(cands, net, compute_spread(cfg, compute_s), model_bytes, data["factors"] if applies else None,
                data["bsp_steps"], why, data.get("bracketed", False))


def job_factors(cfg: JobConfig) -> dict:
    """The shipped convergence factors for this job's learning rate and world size (`load_factors`)."""
    return load_factors(lr=cfg.optimizer.lr, workers=cfg.workers.count)


def factors_line(cfg: JobConfig) -> str:
    """Where the ranking's convergence factors come from, or why none were used (`auto`'s event, `plan`)."""
    data = job_factors(cfg)
    applies, why = factors_apply(cfg, data)
    if applies:
        credited = (f"; measured around this job's rate and world size, so {', '.join(sorted(CREDITED))} count with their "
                    "factors as measured, below 1 too" if data.get("bracketed") else "; the job's rate or world size is "
                    "outside those measured, so no policy is credited with fewer steps than BSP")
        return f"convergence factors: {data['source']}{credited}"
    return f"no convergence factors apply ({why}): exact policies ranked by step time, relaxed ones not recommended"


def choose(cfg: JobConfig, compute_s: float | None = None, model_bytes: float | None = None,
           probed: Sequence[dict] | None = None, cluster: dict | None = None) -> tuple[JobConfig, str, list[Row]]:
    """`sync.policy: auto`: the config with the recommended policy's `sync:` and `compression:`, the
    recommendation line, and the ranked rows (`sync.candidates` narrows the choice). `cluster`: what
    `actors/training/probe.py` measured on the job's Ray cluster (compute, links, placement), used instead of a
    measurement in this process and of the config's network."""
    sync = cfg.sync
    if sync.policy != "auto":
        raise ConfigError(f"sync.policy: choose() resolves auto, and this config names {sync.policy!r}")
    if cluster is not None:
        compute_s, model_bytes = probed_compute_s(cluster), cluster["model_bytes"]
    elif compute_s is None or model_bytes is None:
        compute_s, model_bytes = measure_compute(cfg)
    allowed = set(sync.candidates)
    every = candidates_on(cfg, cluster)
    cands = [c for c in every if not allowed or c.sync["policy"] in allowed or c.label in allowed]
    if not cands:
        raise ConfigError(f"sync.candidates: none of {sorted(allowed)} applies to this job; applicable: "
                          f"{', '.join(c.label for c in every)}")
    rows = ranked(cfg, cands, compute_s, model_bytes, probed, cluster=cluster)
    told = ("the network as told (network: section, a real cluster's; compute measured on it)" if told_network(cfg)
            else "the network as measured" if cluster is not None else
            "the lab's network as asked (network: section)" if cfg.network.enabled else "one node assumed (no probe)")
    line = f"{recommendation(rows)} ({factors_line(cfg)}; {told}" + (f"; {describe_probe(cluster)})" if cluster else ")")
    trial = shortlist(rows, sync.auto.candidates) if sync.auto.trial_steps else []
    asked = len(trial)
    job = job_steps(cfg, trial)
    while len(trial) >= 2 and job is not None and trial_cost(trial, sync.auto.trial_steps) > sync.auto.max_share * job:
        trial = trial[:-1]
    first = trial[0].candidate if len(trial) >= 2 else rows[0].candidate
    raw = with_candidate(cfg, first).to_dict()
    if len(trial) >= 2:
        fewer = (f" ({len(trial)} of the {asked} asked: the job's predicted {job:.0f} steps allow a trial of about "
                 f"{trial_cost(trial, sync.auto.trial_steps)}, sync.auto.max_share {sync.auto.max_share:g})"
                 if len(trial) < asked and job is not None else "")
        line = (f"trying {', '.join(r.candidate.label for r in trial)} for {sync.auto.trial_steps} steps each "
                f"(whole rounds for a periodic kind){fewer}, then the best measured; the model: {line}")
        raw["policy_trial"] = {"steps": sync.auto.trial_steps, "candidates": [
            {"label": r.candidate.label, "sync": copy.deepcopy(r.candidate.sync),
             "compression": {**raw["compression"], "codec": r.candidate.compression.get("codec", "none")},
             "step_s": r.step_s, "factor": r.factor if r.factor is not None else 1.0} for r in trial]}
    elif sync.auto.trial_steps and asked >= 2:
        line = (f"no trial: the job's predicted {job:.0f} steps are too few (a trial of {asked} candidates takes about "
                f"{trial_cost(shortlist(rows, asked), sync.auto.trial_steps)} steps, of 2 about "
                f"{trial_cost(shortlist(rows, 2), sync.auto.trial_steps)}; sync.auto.max_share "
                f"{sync.auto.max_share:g} of the job); {line}")
    elif sync.auto.trial_steps:
        line = (f"no trial: {len(trial)} switchable candidate(s) (of {', '.join(sorted(SWITCHABLE))}, exact or with "
                f"factors for this workload); {line}")
    raw["policy_choice"] = f"sync.policy auto picked {line}"
    return parse(JobConfig, raw), line, rows


def job_steps(cfg: JobConfig, trial: Sequence[Row]) -> float | None:
    """The job's predicted length in steps: `stop.max_steps`, or, with a target and convergence factors that
    apply, counted at this job's target, rate and global batch (`bsp_steps_apply`), BSP's steps to it times
    the factor of the policy it starts on (the trial's first); the shorter of the two. None where neither is
    known (the job stops on time, or on a target the factors' count does not hold for)."""
    limits: list[float] = [float(cfg.stop.max_steps)] if cfg.stop.max_steps else []
    data = job_factors(cfg)
    if cfg.stop.target is not None and trial and data.get("bsp_steps") and factors_apply(cfg, data)[0] \
            and bsp_steps_apply(cfg, data)[0]:
        limits.append(data["bsp_steps"] * (trial[0].factor or 1.0))
    return min(limits) if limits else None


def trial_cost(trial: Sequence[Row], steps: int) -> int:
    """About how many steps a trial of `trial`'s candidates takes: each candidate's first commit after the
    switch (`commit_gap`), its turn (`turn_steps`: whole rounds), and the wait for the commit at which the
    members adopt the next switch (up to another gap)."""
    return sum(2 * commit_gap(row.candidate.spec) + turn_steps({"sync": row.candidate.sync}, steps) for row in trial)


def commit_gap(spec: PolicySpec) -> int:
    """Steps between a policy's commit points: 1 for a synchronous kind, h for a periodic round, and for
    streaming DiLoCo, whose fragments merge in turn, h / fragments plus the overlap of a merge."""
    return max(spec.h // max(spec.fragments, 1), 1) + spec.overlap


def shortlist(rows: Sequence[Row], k: int) -> list[Row]:
    """The online trial's candidates: the best `k` ranked rows a job can switch between mid-run
    (`SWITCHABLE`) whose convergence is known here (exact, or with factors for this workload)."""
    return [r for r in rows if r.candidate.sync["policy"] in SWITCHABLE and (r.exact or r.factor is not None)][:k]


def refuse_resume(policy: str) -> None:
    """ConfigError for a policy that cannot resume from a checkpoint."""
    if policy == "shadow":
        raise ConfigError("--resume: policy 'shadow' does not resume from a checkpoint yet (its lease table "
                          "lives on the dispenser and is not saved); start a new run")


def resumed_choice(cfg: JobConfig, checkpoint: str | Path, read: Callable[[str], bytes] | None = None) -> tuple[JobConfig, str]:
    """`auto` on `--resume`: the policy the checkpoint's run picked (its run directory's config.yaml,
    written once `auto` was resolved), since the checkpoint holds that policy's state. `read`: how to
    read a location (a remote storage's; default the local disk)."""
    import yaml

    location = str(checkpoint)
    path = location.rsplit("/", 2)[0] + "/config.yaml"
    try:
        ran = yaml.safe_load((read or (lambda p: Path(p).read_bytes()))(path))
        sync, codec = ran["sync"], ran["compression"]["codec"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as err:
        raise ConfigError(f"sync.policy: auto with --resume needs the policy the checkpoint's run picked, from "
                          f"{path}: {err}") from None
    refuse_resume(sync["policy"])  # `auto` picked it: the CLI's check saw only "auto"
    raw = cfg.to_dict()
    raw["sync"], raw["compression"] = sync, {**raw["compression"], "codec": codec}
    line = f"{sync['policy']}: the policy the resumed run picked ({path})"
    trial = ran.get("policy_trial") if isinstance(ran, dict) else None
    if trial:  # the trial switched mid-run: the state is under any of its candidates, and says which
        raw["policy_trial"] = {**trial, "resumed": True}  # the workers take the state's; no new trial
        line = (f"the policy its state was saved under, among the resumed run's trial candidates "
                f"({', '.join(c['label'] for c in trial['candidates'])}; {path})")
    raw["policy_choice"] = f"sync.policy auto kept {line}"
    return parse(JobConfig, raw), line
