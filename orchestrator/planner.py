"""Choosing a policy: every applicable policy's predicted time per step, bytes per step and time to
the target on a network, from the runtime model (algorithms/runtime_model.py), and a recommendation.

The inputs are a job config (its workload, optimizer, world size and stragglers), a network (the
`network:` section as asked, or the lab's links as probed) and the compute time of one step, measured
here on the workload (`measure_compute`). Time to the target multiplies the predicted step time by
the steps BSP needs and the policy's convergence factor (steps to the target relative to BSP), where
one was measured (`orchestrator/convergence.json`, written by `benchmarks/tradeoffs.py`, which names
its workload and date); without a factor a policy is ranked by its step time and the table says so.

`python -m orchestrator plan CONFIG [--network FILE | --probe]` prints the table; `sync.policy: auto`
resolves through `choose` before the job starts (`ElasticJob.start`), and the job's first event says
what was picked and why.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from algorithms.runtime_model import CODEC_RATIO, INF, Compute, Network, PolicySpec, cpu_time, host_patterns, predict
from core.schema import POLICIES, ConfigError, JobConfig, NetworkConfig, parse

FACTORS_PATH = Path(__file__).with_name("convergence.json")


@dataclass(frozen=True)
class Candidate:
    """One policy as `plan` weighs it: a label, its `sync:`/`compression:` sections, the model's view."""

    label: str
    sync: dict
    compression: dict
    spec: PolicySpec


@dataclass(frozen=True)
class Row:
    candidate: Candidate
    step_s: float
    bytes_per_step: float
    factor: float | None
    """Steps to the target relative to BSP as ranked (the measured factor, never below 1 for a relaxed
    policy), or None where no factor applies."""
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
SWITCHABLE = frozenset(row.name for row in POLICIES if row.switchable)
"""The policies an online trial (`sync.auto`) may switch between mid-run (the policy table's
`switchable`): each holds BSP's replicated state at its commit points (the same parameters on every
member after a step or a round), so a switch at one loses and repeats no sample. Streaming DiLoCo is not
among them: its members' parameters differ at a commit point by design (fragments merge at different
steps). The inner optimizer's state of the periodic ones is each member's own: at a switch every member
takes rank 0's."""
RELAXED_MARGIN = 0.10
"""A relaxed policy is recommended over the best exact one only if its predicted time to the target is at
least this much lower: the factors come from a few seeds (over three seeds the same policy's factor
ranged 0.76-1.07) and the model's step times are within 25%, so a smaller lead is not evidence."""


def candidates(cfg: JobConfig, nodes: int | None = None) -> list[Candidate]:
    """The policies this job could run with, each with the knobs the comparison uses. Adam-based ones
    (`qadam`, `dadam`) with an AdamW optimizer, the others with SGD; hierarchical BSP where the
    network has more than one node. The server kinds are left out: their pushes and pulls travel on
    Ray's own transport, which the lab does not shape, so the model would compare them on other terms.
    `nodes`: the nodes the ranks were measured on (a probe of the user's cluster), else the lab's."""
    adam = cfg.optimizer.name == "adamw"
    nodes = cfg.network.nodes if nodes is None else nodes
    ring = {"kind": "ring"}
    bucket = getattr(cfg.sync, "bucket_mb", 25.0) * 2 ** 20  # the job's own bucket size where it sets one
    out = [("bsp", {"policy": "bsp"}, {}, PolicySpec("bsp", bucket_bytes=bucket))]
    if nodes > 1:
        out.append(("bsp hierarchical", {"policy": "bsp", "hierarchical": True}, {},
                    PolicySpec("bsp", hierarchical=True)))
    out.append(("bytegrad uint8", {"policy": "bytegrad"}, {"codec": "uint8"},
                PolicySpec("bytegrad", codec_ratio=CODEC_RATIO["uint8"], codec="uint8")))
    if nodes > 1:
        out.append(("bytegrad hierarchical uint8", {"policy": "bytegrad", "hierarchical": True}, {"codec": "uint8"},
                    PolicySpec("bytegrad", codec_ratio=CODEC_RATIO["uint8"], codec="uint8", hierarchical=True)))
    if adam:
        steps = cfg.stop.max_steps or 0
        out.append(("qadam uint8", {"policy": "qadam", "warmup_steps": 100}, {"codec": "uint8"},
                    PolicySpec("qadam", codec_ratio=CODEC_RATIO["uint8"], codec="uint8", warmup_steps=100,
                               total_steps=steps)))
    out.append(("local_sgd h=8", {"policy": "local_sgd", "h": 8}, {}, PolicySpec("local_sgd", h=8)))
    out.append(("diloco h=16", {"policy": "diloco", "h": 16}, {}, PolicySpec("diloco", h=16)))
    out.append(("streaming_diloco h=16 f=4", {"policy": "streaming_diloco", "h": 16, "fragments": 4, "overlap": 1},
                {}, PolicySpec("streaming_diloco", h=16, fragments=4, overlap=1)))
    out.append(("dpsgd ring", {"policy": "dpsgd", "topology": ring}, {}, PolicySpec("dpsgd")))
    out.append(("dpsgd ring uint8", {"policy": "dpsgd", "topology": ring}, {"codec": "uint8"},
                PolicySpec("dpsgd", codec_ratio=CODEC_RATIO["uint8"], codec="uint8")))
    if adam:
        out.append(("dadam ring k=4", {"policy": "dadam", "topology": ring, "k": 4}, {}, PolicySpec("dadam")))
    else:
        out.append(("choco ring uint8", {"policy": "choco", "topology": ring}, {"codec": "uint8"},
                    PolicySpec("choco", codec_ratio=CODEC_RATIO["uint8"], codec="uint8")))
    out.append(("shadow ma", {"policy": "shadow", "method": "ma"}, {}, PolicySpec("shadow")))
    return [Candidate(label, sync, comp, spec) for label, sync, comp, spec in out]


def network_for(net: NetworkConfig, world: int, probed: Sequence[dict] | None = None,
                host_s: dict[str, float] | None = None) -> Network:
    """The model's network for `world` members placed as the job places them (`NetworkConfig.node_of`):
    the links as asked, or as `lab.probe` measured them (`probed` rows), with the host time of each
    synchronization pattern (`host_s`, from `measure_host`) where given. Without a lab (`nodes: 0`)
    every member shares one unshaped node. A real cluster's links as told (`emulate: false`): each node's
    flows to other nodes share its NIC, at its fastest told link (the lab shapes pairs, not NICs)."""
    if not net.enabled:
        return Network(tuple(0 for _ in range(world)), ((INF,),), ((0.0,),))
    nodes = net.nodes
    bandwidth = [[INF if net.link(a, b).mbit is None else net.link(a, b).mbit * 1e6 / 8 for b in range(nodes)]
                 for a in range(nodes)]
    latency = [[net.link(a, b).latency_ms / 1e3 for b in range(nodes)] for a in range(nodes)]
    loopback, host = Network.loopback_bytes_per_s, INF
    for row in probed or ():
        a, b = row["a"], row["b"]
        if row.get("asked_mbit"):
            bandwidth[a][b] = row["measured_mbit"] * 1e6 / 8
        elif a == b:  # an unshaped stream: what a loopback flow moves, and what this machine's cores copy at most
            loopback = host = row["measured_mbit"] * 1e6 / 8
        latency[a][b] = row["modelled_latency_ms"] / 1e3 + row["rtt_ms"] / 2e3
    nic = _nic_at_fastest_link(bandwidth) if not net.emulate else ()
    return Network(tuple(net.node_of(f"w{i}") for i in range(world)), tuple(map(tuple, bandwidth)),
                   tuple(map(tuple, latency)), loopback, host, tuple(sorted((host_s or {}).items())), nic)


def _nic_at_fastest_link(bandwidth: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Each node's NIC rate on a real cluster: its fastest link to another node (links measured or told
    one pair at a time, so one flow had the NIC to itself); INF for a node with no other."""
    nodes = len(bandwidth)
    return tuple(max((bandwidth[a][b] for b in range(nodes) if b != a), default=INF) for a in range(nodes))


def told_network(cfg: JobConfig) -> bool:
    """The config describes the real cluster's links (`network:` with `emulate: false`): the planner ranks
    on them as told, and measures only the compute (and placement) on the cluster."""
    return cfg.network.enabled and not cfg.network.lab


def network_from_probe(cluster: dict) -> Network:
    """The model's network as `actors/probe.py` measured it on the user's cluster: the ranks on the nodes
    the probes landed on, each node pair's rate and latency (symmetric: one all-reduce measures both
    directions at once), and a node's own rate where two probes shared it (else the model's default).
    Real nodes: no host time is counted (each has its own cores and NIC), and every node's flows to
    other nodes share its NIC, whose rate is the fastest pair measured from it (the probe times one
    pair at a time, so one flow had the NIC to itself)."""
    nodes = len(cluster["nodes"])
    bandwidth = [[INF] * nodes for _ in range(nodes)]
    latency = [[0.0] * nodes for _ in range(nodes)]
    loopback = Network.loopback_bytes_per_s
    for link in cluster["links"]:
        a, b = link["a"], link["b"]
        if a == b:
            loopback = link["bytes_per_s"]
            latency[a][a] = link["latency_s"]
        else:
            bandwidth[a][b] = bandwidth[b][a] = link["bytes_per_s"]
            latency[a][b] = latency[b][a] = link["latency_s"]
    return Network(tuple(cluster["node_of_rank"]), tuple(map(tuple, bandwidth)), tuple(map(tuple, latency)), loopback,
                   nic_bytes_per_s=_nic_at_fastest_link(bandwidth))


def rank_medians(cluster: dict) -> list[float]:
    """Each rank's median step as its probe measured it."""
    return [statistics.median(times) for times in cluster["compute"]]


def probed_compute_s(cluster: dict) -> float:
    """One step's compute as the probes measured it: the median over ranks of each rank's median."""
    return statistics.median(rank_medians(cluster))


def compute_from_probe(cfg: JobConfig, cluster: dict, told_s: float | None = None) -> Compute:
    """The compute side as measured on the placed probes: the median step over ranks, each rank's factor
    (its median over that), and the jitter (the median over ranks of the standard deviation of log step
    time), times any modelled `faults.stragglers` of the config. `told_s` (`plan --compute-ms`) replaces
    the measured median step; the ranks' factors, the spread and backward's share stay as measured."""
    import math

    medians = rank_medians(cluster)
    measured = statistics.median(medians)
    overall = told_s if told_s is not None else measured
    modelled = compute_spread(cfg, overall)
    factors = tuple(m / measured * modelled.factor(r) for r, m in enumerate(medians))
    spreads = [statistics.pstdev([math.log(t) for t in times]) for times in cluster["compute"] if len(times) > 1]
    sigma = max(statistics.median(spreads) if spreads else 0.0, modelled.jitter_sigma)
    backward = statistics.median(statistics.median(b) for b in cluster["backward"]) if cluster.get("backward") else 0.0
    return Compute(overall, factors=factors, jitter_sigma=sigma, backward_s=backward * overall / measured)


def describe_probe(cluster: dict) -> str:
    """One line: what the probe measured (for `plan` and `auto`'s event)."""
    medians = rank_medians(cluster)
    links = "; ".join(f"{cluster['nodes'][link['a']]}<->{cluster['nodes'][link['b']]} "
                      f"{link['bytes_per_s'] * 8 / 1e6:.0f} Mbit/s, {link['latency_s'] * 1e3:.2f} ms"
                      for link in cluster["links"]) or "none (every rank on one node)"
    return (f"measured on the cluster: {len(cluster['nodes'])} node(s), ranks on nodes {cluster['node_of_rank']}; "
            f"one step's compute {statistics.median(medians) * 1e3:.2f} ms (ranks {min(medians) * 1e3:.2f}-"
            f"{max(medians) * 1e3:.2f}) on {cluster['device']} with {cluster['threads']} thread(s); links: {links}")


def measure_host(cfg: JobConfig, cands: Sequence[Candidate], model_bytes: float, rounds: int = 40,
                 warmup: int = 5) -> dict[str, float]:
    """Each synchronization pattern the candidates run (`host_patterns`), timed among the job's count of
    ranks on this machine, each rank a process of its own as the lab's workers are, over gloo on
    127.0.0.1 with no link shaped, by the project's own code for it (the all-reduce, the compressed
    scatter-gather, the gossip policy's exchange and mixing). For each pattern, "PATTERN" is the median
    wall time of one synchronization and "PATTERN:cpu" the median CPU time of the rank's own thread in
    it (encoding, decoding, arithmetic; not the transport's threads): what the lab's emulated nodes,
    which share this machine's cores, pay for a synchronization however fast the links are."""
    import os  # only plan, auto and the benchmark measure
    import subprocess
    import sys

    from actors.store import serve_store

    labels: dict[str, str] = {}
    for cand in cands:
        for pattern in host_patterns(cand.spec):
            labels.setdefault(pattern, cand.label)
    if not labels:
        return {}
    world = cfg.workers.count
    _store, port, sock = serve_store("127.0.0.1", 120.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs: list[subprocess.Popen] = []
    try:  # fresh interpreters (not multiprocessing: a spawned child would import the caller's main module)
        for rank in range(world):
            task = json.dumps({"config": cfg.to_dict(), "labels": labels, "model_bytes": model_bytes, "port": port,
                               "rank": rank, "rounds": rounds, "warmup": warmup})
            procs.append(subprocess.Popen([sys.executable, "-c", "from orchestrator.planner import _host_rank; _host_rank()",
                                           task], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True))
        ranks = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
                raise RuntimeError(f"measuring this machine's synchronizations failed: {last}")
            ranks.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        sock.close()
    measured: dict[str, float] = {}
    for pattern in labels:
        measured[pattern] = statistics.median(rank[pattern][0] for rank in ranks)
        measured[cpu_time(pattern)] = statistics.median(rank[pattern][1] for rank in ranks)
    return measured


def _host_rank() -> None:
    """One rank of `measure_host`, in an interpreter of its own: its task as JSON in argv, every pattern
    in turn (each on its own group), {pattern: [wall, cpu]} as JSON on stdout."""
    import os
    import sys

    import torch

    from actors.comm import GroupSpec, make_communicator

    task = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    cfg = parse(JobConfig, task["config"])
    by_label = {c.label: c for c in candidates(cfg)}
    world, rank, warmup = cfg.workers.count, task["rank"], task["warmup"]
    numel = max(int(task["model_bytes"] // 4), 1)
    out = {}
    for pattern, label in task["labels"].items():
        comm = make_communicator(GroupSpec("127.0.0.1", task["port"], f"host/{pattern}", rank, world, 60.0, "gloo",
                                           "127.0.0.1"))
        try:
            run = _pattern_step(cfg, by_label[label], pattern, comm, numel)
            times, cpu = [], []
            for step in range(1, warmup + task["rounds"] + 1):
                began, began_cpu = time.perf_counter(), time.thread_time()
                run(step)
                if step > warmup:
                    times.append(time.perf_counter() - began)
                    cpu.append(time.thread_time() - began_cpu)
            out[pattern] = (statistics.median(times), statistics.median(cpu))
        finally:
            comm.close()
    print(json.dumps(out), flush=True)
    os._exit(0)  # past here only the store's and gloo's threads, whose teardown at exit can abort the process


def _pattern_step(cfg: JobConfig, cand: Candidate, pattern: str, comm, numel: int):
    """One synchronization of `pattern` on `comm` (a model of `numel` floats), as a function of the step."""
    import torch

    kind, _, arg = pattern.partition("/")
    if kind == "allreduce":
        tensor = torch.ones(max(numel // int(arg or 1), 1))
        return lambda step: comm.all_reduce(tensor).wait()
    if kind == "scatter_gather":
        from algorithms.compression import get_codec
        from algorithms.scatter_gather import ScatterGather

        codec = get_codec(arg)
        sg = ScatterGather(codec, numel, feedback=codec.needs_feedback)
        sg.bind(comm)
        tensor, tail = torch.randn(numel), torch.zeros(sg.tail_numel)
        return lambda step: sg.all_reduce(tensor, tail)
    return _policy_step(cfg, cand, comm, numel)


def _policy_step(cfg: JobConfig, cand: Candidate, comm, numel: int):
    """One step of the candidate's policy on a model of one flat parameter of `numel` floats, in the
    worker's order of hooks, with a backward that only sets the gradient and the update at lr 0: what
    the step adds to the forward and backward (the gradients' all-reduce, or the exchange and mixing)."""
    import torch

    from algorithms.base import EpochInfo, VoteDraft, get_algorithm
    from algorithms.optim import build_optimizer

    job = with_candidate(cfg, cand)
    model = torch.nn.Module()
    model.flat = torch.nn.Parameter(torch.randn(numel) * 0.01)
    impl = get_algorithm(job.sync.policy)(job.sync, job.compression).bind(model, build_optimizer(model.parameters(), job.optimizer))
    slots = tuple(f"w{i}" for i in range(comm.world_size))
    nodes = tuple(str(job.network.node_of(s)) for s in slots) if job.network.lab else ()
    impl.on_membership(comm, EpochInfo(comm.rank, comm.world_size, slots, comm.world_size, 1, nodes))

    def step(index: int) -> None:
        draft = VoteDraft(samples=1)
        impl.begin_step(index, draft)
        impl.before_forward(index)
        impl.backward(model.flat.sum())
        impl.end_backward(index)
        impl.finish_step(index, draft)
        impl.apply_update(index, 0.0)
        impl.commit(index)

    return step


def candidates_on(cfg: JobConfig, cluster: dict | None) -> list[Candidate]:
    """`candidates` for the nodes the ranks run on: those the probes landed on (`cluster`), unless the
    config tells the cluster's network (then its nodes), else the lab's."""
    return candidates(cfg, len(cluster["nodes"]) if cluster is not None and not told_network(cfg) else None)


def with_candidate(cfg: JobConfig, cand: Candidate) -> JobConfig:
    """The job's config with the candidate's `sync:` and codec."""
    raw = cfg.to_dict()
    raw["sync"] = copy.deepcopy(cand.sync)
    raw["compression"] = {**raw["compression"], "codec": cand.compression.get("codec", "none")}
    return parse(JobConfig, raw)


def compute_spread(cfg: JobConfig, seconds: float) -> Compute:
    """The compute side: `seconds` per step, times each slot's `faults.stragglers` slowdown, with the
    largest jitter sigma configured (the model draws it on every rank)."""
    world = cfg.workers.count
    factors = tuple(max([s.slowdown for s in cfg.faults.stragglers if s.slot == f"w{i}"] or [1.0]) for i in range(world))
    sigma = max([s.jitter.sigma for s in cfg.faults.stragglers if s.jitter is not None] or [0.0])
    return Compute(seconds, factors=factors, jitter_sigma=sigma)


def measure_compute(cfg: JobConfig, steps: int = 12, warmup: int = 3) -> tuple[float, float]:
    """(median seconds of one step's forward, backward and update on one worker's batch, the model's
    parameter bytes), measured in this process on its CPU (`actors.replica.time_steps`)."""
    import torch  # only `plan` and `auto` measure

    from actors.replica import time_steps

    measured = time_steps(cfg, torch.device("cpu"), steps, warmup)
    return statistics.median(measured["times"]), measured["model_bytes"]


def load_factors(path: Path = FACTORS_PATH) -> dict:
    """{"factors": {label: steps to the target relative to BSP}, "bsp_steps": BSP's steps to the target,
    "source": "...", "applies_to": {"workload": module, "optimizer": name, "metric": name}} as
    `benchmarks/tradeoffs.py` wrote them; empty factors when none were measured."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    return {"factors": {k: float(v) for k, v in data.get("factors", {}).items()},
            "bsp_steps": int(data.get("bsp_steps") or 0) or None, "source": str(data.get("source", "")),
            "applies_to": dict(data.get("applies_to") or {})}


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


def rank(cands: Sequence[Candidate], net: Network, compute: Compute, model_bytes: float,
         factors: dict[str, float] | None, bsp_steps: int | None = None, unknown: str = "") -> list[Row]:
    """Every candidate's prediction, the recommended one first.

    With `factors` (they apply to this job, `factors_apply`): time to the target is step time x BSP's
    steps x the factor, a relaxed policy's factor taken as at least 1 (it is never credited with
    converging faster than BSP: factors below 1 were seed noise); a candidate without a factor gets
    none. The best exact policy is recommended unless a relaxed one's time to the target is at least
    RELAXED_MARGIN lower. Without factors (`unknown` says why): the exact policies by step time first,
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
            factor = max(factor, 1.0)
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
            and known[0].to_target_s > (1 - RELAXED_MARGIN) * exact_best.to_target_s:
        known.remove(exact_best)
        known.insert(0, exact_best)  # the relaxed lead is within the evidence's error: the exact policy
    return known + rest


def ranked(cfg: JobConfig, cands: Sequence[Candidate], compute_s: float, model_bytes: float,
           probed: Sequence[dict] | None = None, host_s: dict[str, float] | None = None,
           cluster: dict | None = None) -> list[Row]:
    """`rank` on the job's own network (as asked, or `probed`) and stragglers, with the shipped
    convergence factors: what `plan` prints and `auto` picks from. In the lab, whose nodes share this
    machine, each synchronization pattern's host time is this machine's (`host_s`, measured here by
    `measure_host` when not given); elsewhere none is counted."""
    data = load_factors()
    applies, why = factors_apply(cfg, data)
    if cluster is not None:  # measured on the user's cluster (actors/probe.py); its links as told, if they were
        net = network_for(cfg.network, cfg.workers.count) if told_network(cfg) else network_from_probe(cluster)
        return rank(cands, net, compute_from_probe(cfg, cluster, compute_s), cluster["model_bytes"],
                    data["factors"] if applies else None, data["bsp_steps"], why)
    if host_s is None and cfg.network.lab:
        host_s = measure_host(cfg, cands, model_bytes)
    net = network_for(cfg.network, cfg.workers.count, probed, host_s)
    return rank(cands, net, compute_spread(cfg, compute_s), model_bytes, data["factors"] if applies else None,
                data["bsp_steps"], why)


def factors_line(cfg: JobConfig) -> str:
    """Where the ranking's convergence factors come from, or why none were used (`auto`'s event, `plan`)."""
    data = load_factors()
    applies, why = factors_apply(cfg, data)
    if applies:
        return f"convergence factors: {data['source']}"
    return f"no convergence factors apply ({why}): exact policies ranked by step time, relaxed ones not recommended"


def recommendation(rows: Sequence[Row]) -> str:
    """One line: the pick and why (against BSP when BSP was a candidate)."""
    best = rows[0]
    bsp = next((r for r in rows if r.candidate.label == "bsp"), None)
    if bsp is None or bsp is best:
        fastest = min(rows, key=lambda r: r.step_s)
        if best.to_target_s is not None:
            why = f"predicted {best.to_target_s:.1f} s to the target ({best.step_s * 1e3:.1f} ms/step)"
        else:
            why = f"predicted {best.step_s * 1e3:.1f} ms/step"
        if best.exact and fastest is not best:
            why += (f"; the exact policy: {fastest.candidate.label}'s {fastest.step_s * 1e3:.1f} ms/step is not "
                    f"enough of a lead ({fastest.note or 'within the evidence'})")
        return f"{best.candidate.label}: {why}"
    if best.to_target_s is not None:
        why = (f"predicted {best.to_target_s:.1f} s to the target ({best.step_s * 1e3:.1f} ms/step x "
               f"{best.factor:.2f} of BSP's steps) against BSP's {bsp.to_target_s:.1f} s")
    else:
        why = f"predicted {best.step_s * 1e3:.1f} ms/step against BSP's {bsp.step_s * 1e3:.1f} ms"
    return f"{best.candidate.label}: {why}"


def table(rows: Sequence[Row], factors: str) -> str:
    """The rows, one line each, then `factors` (`factors_line`: the convergence factors' source, or why
    none apply)."""
    lines = [f"{'policy':<28} {'ms/step':>9} {'MB/step':>9} {'steps/BSP':>10} {'s to target':>12}"]
    for r in rows:
        factor = f"{r.factor:.2f}" if r.factor is not None else "-"
        target = f"{r.to_target_s:.1f}" if r.to_target_s is not None else ("-" if r.exact else "unknown")
        lines.append(f"{r.candidate.label:<28} {r.step_s * 1e3:>9.2f} {r.bytes_per_step / 1e6:>9.3f} {factor:>10} {target:>12}")
    lines.append(factors)
    return "\n".join(lines)


def choose(cfg: JobConfig, compute_s: float | None = None, model_bytes: float | None = None,
           probed: Sequence[dict] | None = None, cluster: dict | None = None) -> tuple[JobConfig, str, list[Row]]:
    """`sync.policy: auto`: the config with the recommended policy's `sync:` and `compression:`, the
    recommendation line, and the ranked rows (`sync.candidates` narrows the choice). `cluster`: what
    `actors/probe.py` measured on the job's Ray cluster (compute, links, placement), used instead of a
    measurement in this process and of the config's network."""
    if cluster is not None:
        compute_s, model_bytes = probed_compute_s(cluster), cluster["model_bytes"]
    elif compute_s is None or model_bytes is None:
        compute_s, model_bytes = measure_compute(cfg)
    allowed = set(getattr(cfg.sync, "candidates", ()) or ())
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
    trial = shortlist(rows, cfg.sync.auto.candidates) if cfg.sync.auto.trial_steps else []
    first = trial[0].candidate if len(trial) >= 2 else rows[0].candidate
    raw = with_candidate(cfg, first).to_dict()
    if len(trial) >= 2:
        line = (f"trying {', '.join(r.candidate.label for r in trial)} for {cfg.sync.auto.trial_steps} steps each, "
                f"then the best measured; the model: {line}")
        raw["policy_trial"] = {"steps": cfg.sync.auto.trial_steps, "candidates": [
            {"label": r.candidate.label, "sync": copy.deepcopy(r.candidate.sync),
             "compression": {**raw["compression"], "codec": r.candidate.compression.get("codec", "none")},
             "step_s": r.step_s, "factor": r.factor if r.factor is not None else 1.0} for r in trial]}
    elif cfg.sync.auto.trial_steps:
        line = (f"no trial: {len(trial)} switchable candidate(s) (of {', '.join(sorted(SWITCHABLE))}, exact or with "
                f"factors for this workload); {line}")
    raw["policy_choice"] = f"sync.policy auto picked {line}"
    return parse(JobConfig, raw), line, rows


def shortlist(rows: Sequence[Row], k: int) -> list[Row]:
    """The online trial's candidates: the best `k` ranked rows a job can switch between mid-run
    (`SWITCHABLE`) whose convergence is known here (exact, or with factors for this workload)."""
    return [r for r in rows if r.candidate.sync["policy"] in SWITCHABLE and (r.exact or r.factor is not None)][:k]


def refuse_resume(policy: str) -> None:
    """ConfigError for a policy that cannot resume from a checkpoint."""
    if policy == "shadow":
        raise ConfigError("--resume: policy 'shadow' does not resume from a checkpoint yet (its lease table "
                          "lives on the dispenser and is not saved); start a new run")


def resumed_choice(cfg: JobConfig, checkpoint: Path, read: Callable[[str], bytes] | None = None) -> tuple[JobConfig, str]:
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
