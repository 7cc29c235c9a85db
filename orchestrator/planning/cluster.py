"""The cluster as the runtime model sees it (algorithms/rules/runtime_model.py `Network`, `Compute`): the links
as the `network:` section asks (or as `lab.probe` measured them), as `actors/training/probe.py` measured them on
the user's cluster, and one step's compute with the config's stragglers or as the probes measured it."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from algorithms.rules.runtime_model import INF, Compute, Network
from core.schema import JobConfig, NetworkConfig


def _bytes_per_s(mbit: float | None) -> float:
    """A told link's rate in bytes per second; INF for an unshaped one."""
    return INF if mbit is None else mbit * 1e6 / 8


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
    bandwidth = [[_bytes_per_s(net.link(a, b).mbit) for b in range(nodes)] for a in range(nodes)]
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
    share = max(1.0, world / machine_cores()) if net.lab else 1.0  # the lab's nodes share this machine's cores
    return Network(tuple(net.node_of(f"w{i}") for i in range(world)), tuple(map(tuple, bandwidth)),
                   tuple(map(tuple, latency)), loopback, host, tuple(sorted((host_s or {}).items())), nic, share)


def machine_cores() -> int:
    """The cores this process may run on (the lab's emulated nodes all run on them)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


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
    """The model's network as `actors/training/probe.py` measured it on the user's cluster: the ranks on the nodes
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


def compute_spread(cfg: JobConfig, seconds: float) -> Compute:
    """The compute side: `seconds` per step, times each slot's `faults.stragglers` slowdown, with the
    largest jitter sigma configured (the model draws it on every rank)."""
    world = cfg.workers.count
    factors = tuple(max([s.slowdown for s in cfg.faults.stragglers if s.slot == f"w{i}"] or [1.0]) for i in range(world))
    sigma = max([s.jitter.sigma for s in cfg.faults.stragglers if s.jitter is not None] or [0.0])
    return Compute(seconds, factors=factors, jitter_sigma=sigma)


def compute_from_probe(cfg: JobConfig, cluster: dict, told_s: float | None = None) -> Compute:
    """The compute side as measured on the placed probes: the median step over ranks, each rank's factor
    (its median over that), and the jitter (the median over ranks of the standard deviation of log step
    time), times any modelled `faults.stragglers` of the config. `told_s` (`plan --compute-ms`) replaces
    the measured median step; the ranks' factors, the spread and backward's share stay as measured."""
    medians = rank_medians(cluster)
    measured = statistics.median(medians)
    overall = told_s if told_s is not None else measured
    modelled = compute_spread(cfg, overall)
    factors = tuple(m / measured * modelled.factor(r) for r, m in enumerate(medians))
    spreads = [statistics.pstdev([math.log(t) for t in times]) for times in cluster["compute"] if len(times) > 1]
    sigma = max(statistics.median(spreads) if spreads else 0.0, modelled.jitter_sigma)
    backward = statistics.median(statistics.median(b) for b in cluster["backward"]) if cluster.get("backward") else 0.0
    return Compute(overall, factors=factors, jitter_sigma=sigma, backward_s=backward * overall / measured)
