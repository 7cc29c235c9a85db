"""The runtime model: each policy's time per step and bytes per step on a given network. Pure.

Written from the communication patterns, not fitted to measurements. The inputs are what a probe
can measure: the compute time of one step (forward, backward, update; `Compute`), the model's size
in bytes, and the links between nodes (bandwidth each direction and one-way latency; `Network`).
Compute and communication do not overlap except where the policy launches its traffic before the
step's compute (gossip launches its exchange before the forward pass; background rounds run beside
the training thread; streaming DiLoCo's fragments overlap `overlap` steps) or during it (BSP's
gradient buckets, all-reduced as backward produces them: `overlapped_with_backward`, where the
backward pass's time is known), the same order the workers run them in (actors/training/replica.py).

The collectives are gloo's on CPU (what the workers run; actors/transport/comm.py):
- all-reduce: a ring, 2(n-1) rounds; each round every rank sends P/n bytes to the next rank.
- all-gather: a ring, n-1 rounds of one chunk each.
- all-to-all: every rank sends its chunk for every other rank at once (one round).
- point-to-point (gossip): each rank sends P to each of its topology peers at once.
Each round lasts as long as its most loaded link: a kernel-shaped link (one direction between two
nodes) is shared by every flow that crosses it in that round, and pays the link's latency once per
round. Links between workers of one node are loopback, at `Network.loopback_bytes_per_s` per flow;
where the nodes are emulated on one machine, a round also takes at least its total bytes at
`Network.host_bytes_per_s` (the machine's cores copy every byte).

A synchronization also costs the machine's own work: launching it, copying, encoding and decoding,
waking each rank when its data lands, and the policy's arithmetic on what arrived. Where the nodes are
real, that work is small beside the links and the model leaves it out. In the lab every emulated node
shares one machine's cores, and there it is measured (`Network.host_s`): each pattern a policy runs
(`host_patterns`) is timed among as many ranks on this machine, with no link shaped, by the project's
own code for it (`orchestrator/planner.py`: `measure_host`). A synchronization then takes the longer of
its links' time and its host time, as a roofline takes the slower of two resources: ranks that wait on
a slow link leave the cores free, and on a fast link the cores are the bottleneck. Periodic kinds pay it
once per round (amortized over h), gossip once per exchange, the background kind never. D-PSGD's
exchange runs beside its forward pass, so it pays only its own thread's CPU time in the step ("PATTERN:cpu":
encoding, decoding and mixing), which every rank runs at about the same time: where more ranks than cores
share the machine, each gets its share of a core (`Network.cpu_share`). CHOCO mixes before the forward pass
and pays the whole exchange (its wall time, measured among as many ranks, already shared).

A bucketed synchronization (BSP's and `bytegrad`'s gradients in `sync.bucket_mb` buckets) is one collective
per bucket, one after another: each pays its own rounds' latencies, and the host time is measured on the
model's own parameters in the job's buckets.

The compute side: a step's compute on rank i is `fixed_s + seconds * factors[i] * exp(sigma * z)` with z
standard normal, independent across ranks and steps (`Compute`). A step that waits for every member
waits for the maximum over members (its expectation by a fixed-seed sample, so the model is a pure
function); a gossip step waits for its topology neighbours; the background kind never waits.

Each prediction says which formula gave it (`Prediction.basis`), so a reader can check it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from core.schema import POLICY_TABLE

INF = float("inf")


@dataclass(frozen=True)
class Network:
    """Where each rank runs and what each link between nodes gives.

    `bandwidth[a][b]`: bytes/s from node a to node b (INF where unshaped: same node, loopback);
    `latency[a][b]`: one-way seconds (the lab's modelled latency plus the kernel's)."""

    node_of_rank: tuple[int, ...]
    bandwidth: tuple[tuple[float, ...], ...]
    latency: tuple[tuple[float, ...], ...]
    loopback_bytes_per_s: float = 2.0e9
    """What one unshaped flow on this machine moves (a loopback TCP stream between two processes)."""
    host_bytes_per_s: float = INF
    """What all flows of a round move together at most: INF for real nodes (each has its own CPUs and
    NIC); in the lab every emulated node shares one machine's cores, which copy every byte of every
    flow (the probe's unshaped stream, which keeps a sender and a receiver busy, measures it)."""
    host_s: tuple[tuple[str, float], ...] = ()
    """(pattern, seconds): each synchronization pattern's time on this machine's cores with no link
    shaped (`host_patterns` names them; see the module docstring). Empty for real nodes."""
    nic_bytes_per_s: tuple[float, ...] = ()
    """Per node: what its network interface moves each way (bytes/s), shared by every flow that leaves
    the node (egress) or arrives at it (ingress) in a round, whatever node is at the other end. Real
    nodes have one NIC each; empty: no per-node limit, as in the lab, whose kernel shapes each (source
    node, destination node) pair on its own, so a node sending to three others at once gets three
    links' worth. On a ring (each node sends to one other) the two agree; they differ where a node
    talks to several nodes at once (all-to-all, gossip with several peers, a leader's scatter)."""
    cpu_share: float = 1.0
    """How many ranks share each core where the ranks share one machine's cores (the lab: its ranks over this
    machine's cores, at least 1); 1 for real nodes, each rank with cores of its own. A rank's own CPU work in a
    step (`Network.host_s`'s "PATTERN:cpu", a CPU time) runs while every other rank runs the same work, so it
    takes `cpu_share` times as long on the clock."""

    @property
    def n(self) -> int:
        return len(self.node_of_rank)

    def flow_rate(self, i: int, j: int, sharing: int) -> float:
        """Bytes/s of one flow from rank i to rank j when `sharing` flows cross the same link."""
        a, b = self.node_of_rank[i], self.node_of_rank[j]
        shaped = self.bandwidth[a][b]
        if shaped == INF:
            return self.loopback_bytes_per_s
        return min(shaped / max(sharing, 1), self.loopback_bytes_per_s)

    def host(self, pattern: str) -> float:
        """The measured host time of `pattern` (0 where none was measured)."""
        return dict(self.host_s).get(pattern, 0.0)

    def hop_latency(self, i: int, j: int) -> float:
        return self.latency[self.node_of_rank[i]][self.node_of_rank[j]]

    @classmethod
    def uniform(cls, nodes: int, per_node: int, inter_bytes_per_s: float, inter_latency_s: float = 0.0,
                intra_bytes_per_s: float = INF, intra_latency_s: float = 0.0,
                loopback_bytes_per_s: float = 2.0e9, host_bytes_per_s: float = INF,
                host_s: tuple[tuple[str, float], ...] = ()) -> Network:
        ranks = tuple(r // per_node for r in range(nodes * per_node))
        bw = tuple(tuple(intra_bytes_per_s if a == b else inter_bytes_per_s for b in range(nodes)) for a in range(nodes))
        lat = tuple(tuple(intra_latency_s if a == b else inter_latency_s for b in range(nodes)) for a in range(nodes))
        return cls(ranks, bw, lat, loopback_bytes_per_s, host_bytes_per_s, host_s)


@dataclass(frozen=True)
class Compute:
    seconds: float
    """One step's compute on an unslowed rank (median): the part that stragglers and jitter scale."""
    fixed_s: float = 0.0
    """Per-step time no straggler or jitter scales (the framework's own work around the compute)."""
    factors: tuple[float, ...] = ()
    """Per rank slowdown (empty: all 1); a 3x straggler is a 3.0."""
    jitter_sigma: float = 0.0
    """Lognormal jitter of each step on each rank (median factor 1)."""
    samples: int = 4000
    seed: int = 0
    backward_s: float = 0.0
    """The part of `seconds` spent in the backward pass, while BSP's gradient buckets are launched (0:
    unknown, or a compute that is all forward, as the lab's slept compute is)."""

    def factor(self, rank: int) -> float:
        return self.factors[rank] if rank < len(self.factors) else 1.0

    def draws(self, ranks: Sequence[int], steps: int = 1) -> np.ndarray:
        """Sampled compute times, shape (samples, len(ranks)): each the sum over `steps` steps."""
        rng = np.random.default_rng(self.seed)
        base = np.array([self.seconds * self.factor(r) for r in ranks])
        if self.jitter_sigma <= 0:
            return np.broadcast_to((base + self.fixed_s) * steps, (1, len(ranks)))
        z = rng.standard_normal((self.samples, steps, len(ranks)))
        return (base * np.exp(self.jitter_sigma * z) + self.fixed_s).sum(axis=1)

    def expected_max(self, ranks: Sequence[int], steps: int = 1) -> float:
        """E[max over `ranks` of their compute over `steps` steps]."""
        return float(self.draws(ranks, steps).max(axis=1).mean())

    def expected(self, rank: int) -> float:
        mean_jitter = math.exp(self.jitter_sigma ** 2 / 2)
        return self.fixed_s + self.seconds * self.factor(rank) * mean_jitter


@dataclass(frozen=True)
class Prediction:
    policy: str
    step_s: float
    """Time per committed step (periodic kinds: per local step, rounds amortized)."""
    comm_s: float
    """Communication time per step that the step waits for (amortized)."""
    bytes_per_step: float
    """Bytes a rank sends per step (rounds amortized): every rank's where all send alike, else the busiest
    rank's (a hierarchical all-reduce's leader)."""
    basis: str
    notes: str = ""


# --------------------------------------------------------------------------- collectives
def _round_time(net: Network, flows: Sequence[tuple[int, int, float]]) -> float:
    """One round of concurrent flows (src rank, dst rank, bytes): the slowest flow, where flows that
    cross the same shaped link share its rate, or all the round's bytes at the host's rate if that is
    longer (the lab's nodes share one machine), or a node's bytes to or from other nodes at its NIC's
    rate if that is longer (real nodes, `Network.nic_bytes_per_s`); plus the slowest hop's latency."""
    if not flows:
        return 0.0
    sharing: dict[tuple[int, int], int] = {}
    for i, j, _ in flows:
        key = (net.node_of_rank[i], net.node_of_rank[j])
        sharing[key] = sharing.get(key, 0) + 1
    slowest = 0.0
    for i, j, size in flows:
        key = (net.node_of_rank[i], net.node_of_rank[j])
        slowest = max(slowest, size / net.flow_rate(i, j, sharing[key]))
    slowest = max(slowest, sum(size for _, _, size in flows) / net.host_bytes_per_s)
    if net.nic_bytes_per_s:  # each node's NIC carries all its flows to (and from) other nodes
        out: dict[int, float] = {}
        into: dict[int, float] = {}
        for i, j, size in flows:
            a, b = net.node_of_rank[i], net.node_of_rank[j]
            if a != b:
                out[a] = out.get(a, 0.0) + size
                into[b] = into.get(b, 0.0) + size
        for node, total in [*out.items(), *into.items()]:
            slowest = max(slowest, total / net.nic_bytes_per_s[node])
    return slowest + max(net.hop_latency(i, j) for i, j, _ in flows)


def ring_allreduce(net: Network, ranks: Sequence[int], size: float) -> float:
    n = len(ranks)
    if n <= 1:
        return 0.0
    ring = [(ranks[k], ranks[(k + 1) % n], size / n) for k in range(n)]
    return 2 * (n - 1) * _round_time(net, ring)


def ring_allgather(net: Network, ranks: Sequence[int], chunk: float) -> float:
    n = len(ranks)
    if n <= 1:
        return 0.0
    return (n - 1) * _round_time(net, [(ranks[k], ranks[(k + 1) % n], chunk) for k in range(n)])


def all_to_all(net: Network, ranks: Sequence[int], size: float) -> float:
    """Each rank's `size` bytes split evenly, one chunk to every rank (its own stays)."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    return _round_time(net, [(i, j, size / n) for i in ranks for j in ranks if i != j])


def exchange(net: Network, peers: Callable[[int], Sequence[int]], size: float) -> float:
    """Every rank sends `size` bytes to each of its peers at once."""
    return _round_time(net, [(i, j, size) for i in range(net.n) for j in peers(i) if j != i])


def hierarchical_allreduce(net: Network, size: float, codec_ratio: float | None = None) -> float:
    """BAGUA's hierarchical all-reduce (algorithms/policies/hierarchical.py): each non-leader sends its gradients
    to its node's leader (its lowest rank), the leaders all-reduce over the links between nodes (a ring;
    with a codec, the compressed scatter-gather: an all-to-all of chunks at `codec_ratio`, then a ring
    all-gather of the sums), and each leader sends the sum back to its node's members; the intra-node
    parts run on every node at once, in full precision."""
    nodes = sorted(set(net.node_of_rank))
    members = {a: [r for r in range(net.n) if net.node_of_rank[r] == a] for a in nodes}
    leaders = [members[a][0] for a in nodes]
    gather = _round_time(net, [(r, members[a][0], size) for a in nodes for r in members[a][1:]])
    scatter = _round_time(net, [(members[a][0], r, size) for a in nodes for r in members[a][1:]])
    if codec_ratio is None:
        among = ring_allreduce(net, leaders, size)
    else:
        among = all_to_all(net, leaders, size * codec_ratio) + ring_allgather(net, leaders, size * codec_ratio / len(leaders))
    return gather + among + scatter


# --------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class PolicySpec:
    """The policy as the model needs it (from a job config: `policy_spec`)."""

    name: str
    codec_ratio: float = 1.0
    """Bytes on the wire per byte of float32 payload (fp16/bf16 0.5, uint8 about 0.25, onebit 1/32)."""
    codec: str = "none"
    """The codec's name (it names the host pattern: `host_patterns`)."""
    hierarchical: bool = False
    h: int = 1
    """Local steps per round (periodic kinds)."""
    fragments: int = 1
    overlap: int = 0
    warmup_steps: int = 0
    """qadam: full-precision steps before the compressed momentum."""
    total_steps: int = 0
    """qadam: the run's steps (0: unknown, a run without `stop.max_steps`, taken to outlast its warm-up)."""
    bucket_bytes: float = INF
    """The synchronous kinds (`bsp`, `bytegrad`, hierarchical or not): the gradient bucket size
    (`sync.bucket_mb`); INF: one bucket, nothing overlapped."""
    bucket_sizes: tuple[float, ...] = ()
    """Bytes of each gradient bucket, in launch order, as the job's bucketing makes them from the model's
    parameters (`orchestrator/planning/candidates.py`: `with_layout`); empty: `bucket_bytes` split evenly.
    Each bucket is its own collective: it pays its rounds' latencies and launches on its own."""
    interval_s: float = 0.0
    """shadow: seconds from one background round's start to the next (0: back to back)."""
    peers: Callable[[int, int], Sequence[int]] | None = None
    """Gossip: rank -> its topology peers at a world size (default: the ring's two neighbours)."""


def ring_peers(rank: int, n: int) -> list[int]:
    return sorted({(rank - 1) % n, (rank + 1) % n} - {rank})


def host_patterns(spec: PolicySpec) -> tuple[str, ...]:
    """The synchronizations a step of `spec` runs, as keys of `Network.host_s`: "allreduce" (a round's
    all-reduce of the model in float32), "allreduce/F" (one of F fragments), "scatter_gather/CODEC"
    (qadam's compressed momentum), and for the synchronous and gossip families, the step's own
    synchronization: "POLICY/CODEC" with "/hierarchical" where it applies (the gradients' all-reduce, or
    the gossip exchange and its mixing). The periodic family's rounds and the background kind's run the
    model's all-reduce (once per round; the background kind's never hold up a step). None for a policy
    the model has no family for (the server kinds)."""
    row = POLICY_TABLE.get(spec.name)
    family = row.cost_model if row is not None else None
    if spec.name == "qadam":
        return ("allreduce", f"scatter_gather/{spec.codec}")
    if family == "periodic":
        return ("allreduce" if spec.fragments <= 1 else f"allreduce/{spec.fragments}",)
    if family == "background":  # its background rounds: they never hold up a step, but they set its bytes
        return ("allreduce",)
    if family in ("synchronous", "gossip"):
        return (f"{spec.name}/{spec.codec}" + ("/hierarchical" if spec.hierarchical else ""),)
    return ()


def cpu_time(pattern: str) -> str:
    """The `Network.host_s` key of `pattern`'s CPU time in the rank's own thread (its wall time's key is
    `pattern` itself)."""
    return pattern + ":cpu"


def _sync(net: Network, pattern: str, links_s: float) -> float:
    """One synchronization: the longer of its links' time and its host time (the module docstring)."""
    return max(links_s, net.host(pattern))


def predict(spec: PolicySpec, net: Network, compute: Compute, model_bytes: float) -> Prediction:
    """The time per step and bytes per step of `spec` on `net` (see the module docstring)."""
    n = net.n
    ranks = list(range(n))
    everyone = compute.expected_max(ranks)
    name = spec.name
    row = POLICY_TABLE.get(name)
    family = row.cost_model if row is not None else None
    if family == "synchronous":
        return _synchronous(spec, net, compute, model_bytes, everyone)
    if family == "periodic":
        h = max(spec.h, 1)
        waits = compute.expected_max(ranks, steps=h) / h
        pattern = host_patterns(spec)[0]
        if spec.fragments > 1:  # streaming DiLoCo: the round in fragments, each overlapping `overlap` steps
            per_fragment = _sync(net, pattern, ring_allreduce(net, ranks, model_bytes * spec.codec_ratio / spec.fragments))
            hidden = spec.overlap * (compute.fixed_s + compute.seconds)
            exposed = max(0.0, per_fragment - hidden) * spec.fragments / h
            return Prediction(name, waits + exposed, exposed, _ring_bytes(n, model_bytes * spec.codec_ratio) / h,
                              f"E[max_i sum of {h} steps]/{h} + {spec.fragments} fragment all-reduces per {h} steps "
                              f"(each the longer of its links and its host time), each less {spec.overlap} "
                              f"overlapped steps")
        comm = _sync(net, pattern, ring_allreduce(net, ranks, model_bytes * spec.codec_ratio)) / h
        return Prediction(name, waits + comm, comm, _ring_bytes(n, model_bytes * spec.codec_ratio) / h,
                          f"E[max_i sum of {h} steps]/{h} + max(ring all-reduce, host)/{h}")
    if family == "gossip":
        spec_peers = spec.peers
        peers = (lambda r: spec_peers(r, n)) if spec_peers else (lambda r: ring_peers(r, n))
        size = model_bytes * spec.codec_ratio
        comm = exchange(net, peers, size)
        neighbourhood = max(compute.expected_max([r, *peers(r)]) for r in ranks)
        sent = float(np.mean([len(peers(r)) * size for r in ranks]))
        pattern = host_patterns(spec)[0]
        if name == "choco":  # the forward pass needs the mixed point: a rank waits for its peers' messages
            # Nothing overlaps a rank's own wait, but ranks that are not in lockstep do not send at once:
            # a rank waits for its slowest incoming message at the link's full rate, and the links carry
            # every step's traffic (the exchange with every flow sharing) at least.
            incoming = max(_round_time(net, [(j, r, size)]) for r in ranks for j in peers(r) if j != r)
            step = max(comm, neighbourhood + max(incoming, net.host(pattern)))
            return Prediction(name, step, step - neighbourhood, sent,
                              "max(exchange with every flow sharing, E[max over a rank and its peers of compute] + "
                              "the longer of its slowest incoming message alone and the host time): CHOCO mixes "
                              "before its forward pass")
        step = max(neighbourhood + net.host(cpu_time(pattern)) * net.cpu_share, comm)
        return Prediction(name, step, max(0.0, step - neighbourhood), sent,
                          "max(E[max over a rank and its peers of compute] + its own CPU time in the step (times "
                          "the ranks sharing a core), exchange with the peers): the exchange launches before the "
                          "forward pass and overlaps it; encoding, decoding and mixing do not")
    if family == "background":
        own = float(np.median([compute.expected(r) for r in ranks]))
        # A round: the model's ring all-reduce (the longer of its links and its host time, or the interval
        # if longer), plus its snapshot and its write-back, each waiting on average half a foreground step
        # for the model lock. Rounds run back to back beside the steps: bytes per step = a round's bytes x
        # rounds per step.
        round_s = max(_sync(net, "allreduce", ring_allreduce(net, ranks, model_bytes)), spec.interval_s) + own
        rounds = own / round_s if round_s > 0 else 0.0
        return Prediction(name, own, 0.0, _ring_bytes(n, model_bytes) * rounds,
                          "each member at its own pace; background rounds (all-reduce + a step's wait for the lock) "
                          "run beside training, their bytes spread over the steps they span",
                          notes="background rounds share the links and CPU; their time is not counted in a step")
    raise KeyError(f"the runtime model has no pattern for policy {name!r} (its `cost_model` in the policy table, "
                   f"core/schema/policies.py `POLICIES`: {family!r})")


def buckets(spec: PolicySpec, model_bytes: float) -> list[float]:
    """The bytes of each of `spec`'s gradient buckets (one bucket of the whole model where it has none):
    `bucket_sizes` in their proportions, scaled to `model_bytes`."""
    if spec.bucket_sizes:
        total = sum(spec.bucket_sizes)
        return [b * model_bytes / total for b in spec.bucket_sizes]
    if spec.bucket_bytes >= INF or spec.bucket_bytes <= 0:
        return [model_bytes]
    k = max(1, math.ceil(model_bytes / spec.bucket_bytes))
    return [model_bytes / k] * k


def overlapped_with_backward(comm: float, backward_s: float, sizes: list[float],
                             shares: list[float] | None = None) -> float:
    """The part of a bucketed all-reduce (`comm` seconds in all) that a step waits for after its backward
    pass. Bucket i holds `sizes[i]` bytes and is ready once backward has produced them: at the running
    sum of the sizes up to it, over their total, of `backward_s`. Its all-reduce takes its share of
    `comm` (`shares`, each bucket's own link time, its latencies included; by default its bytes) and
    starts when both it is ready and the bucket before it is done. What is left after backward is the
    last one's finish less `backward_s`. Equal buckets that each all-reduce faster than backward fills
    the next leave only the last one's comm/k; slower ones run back to back from the first one's
    readiness: comm - backward (k-1)/k. One bucket: launched after backward, all of `comm`."""
    k = len(sizes)
    if k <= 1 or backward_s <= 0:
        return comm
    weights = shares if shares is not None and sum(shares) > 0 else sizes
    total, weight = sum(sizes), sum(weights)
    finish, produced = 0.0, 0.0
    for size, share in zip(sizes, weights):
        produced += size
        finish = max(finish, backward_s * produced / total) + comm * share / weight
    return max(finish - backward_s, 0.0)


def _ring_bytes(n: int, size: float) -> float:
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def _leader_bytes(net: Network, model_bytes: float, among_size: float) -> float:
    """What the busiest rank of a hierarchical all-reduce sends: the leader of the largest node, which
    sends its node's sum to each of its members in full precision and 2(k-1)/k of `among_size` to the
    other leaders (a ring, or the compressed scatter-gather). Bytes per step are the busiest rank's
    wherever ranks differ (rank 0, a leader, is the one whose count a job's history records)."""
    nodes = list(net.node_of_rank)
    k = len(set(nodes))
    largest = max(nodes.count(a) for a in set(nodes))
    return (largest - 1) * model_bytes + _ring_bytes(k, among_size)


def _synchronous(spec: PolicySpec, net: Network, compute: Compute, model_bytes: float, everyone: float) -> Prediction:
    """The synchronous family: `bytegrad`'s compressed scatter-gather and `qadam`'s warm-up have their own
    formulas; every other synchronous policy (`bsp`, and one added later until it gets its own) all-reduces
    the gradients each step."""
    n = net.n
    ranks = list(range(n))
    parts = buckets(spec, model_bytes) if spec.name != "qadam" else [model_bytes]
    each = f", one per bucket ({len(parts)} buckets)" if len(parts) > 1 else ""
    if spec.name not in ("bytegrad", "qadam"):
        if spec.hierarchical:
            links = sum(hierarchical_allreduce(net, b) for b in parts)
            comm = _sync(net, host_patterns(spec)[0], links)
            basis = ("E[max_i compute] + max(intra-node reduce + leaders' ring all-reduce + intra-node broadcast"
                     f"{each}, host)")
            return Prediction(spec.name, everyone + comm, comm, _leader_bytes(net, model_bytes, model_bytes), basis)
        per_bucket = [ring_allreduce(net, ranks, b) for b in parts]
        comm = _sync(net, host_patterns(spec)[0], sum(per_bucket))
        exposed = overlapped_with_backward(comm, compute.backward_s, parts, per_bucket)
        basis = f"E[max_i compute] + max(ring all-reduce of the gradients{each}, host)"
        if exposed < comm:
            basis += (f", less what overlaps backward: {len(parts)} buckets launched "
                      f"as backward produces them (the last one's all-reduce after it)")
        return Prediction(spec.name, everyone + exposed, exposed, _ring_bytes(n, model_bytes), basis)
    size = model_bytes * spec.codec_ratio
    compressed = host_patterns(spec)[-1]
    scatter_gather = _sync(net, compressed, sum(all_to_all(net, ranks, b * spec.codec_ratio)
                                                + ring_allgather(net, ranks, b * spec.codec_ratio / n) for b in parts))
    sg_bytes = 2 * (n - 1) / n * size
    if spec.name == "bytegrad" and spec.hierarchical:
        comm = _sync(net, compressed, sum(hierarchical_allreduce(net, b, spec.codec_ratio) for b in parts))
        return Prediction("bytegrad", everyone + comm, comm, _leader_bytes(net, model_bytes, size),
                          "E[max_i compute] + max(intra-node reduce + leaders' compressed scatter-gather + "
                          f"intra-node broadcast{each}, host)")
    if spec.name == "bytegrad":
        return Prediction("bytegrad", everyone + scatter_gather, scatter_gather, sg_bytes,
                          "E[max_i compute] + max(all-to-all of compressed chunks + ring all-gather of the sums"
                          f"{each}, host)")
    # qadam: full-precision ring all-reduce during warm-up, then the compressed momentum's scatter-gather
    full = _sync(net, "allreduce", ring_allreduce(net, ranks, model_bytes))
    total = spec.total_steps
    warm = min(spec.warmup_steps, total) / total if total > 0 else 0.0  # no end given: past its warm-up
    comm = warm * full + (1 - warm) * scatter_gather
    return Prediction("qadam", everyone + comm, comm, warm * _ring_bytes(n, model_bytes) + (1 - warm) * sg_bytes,
                      f"E[max_i compute] + {warm:.0%} ring all-reduce (warm-up) + {1 - warm:.0%} compressed "
                      f"scatter-gather, each the longer of its links and its host time")


CODEC_RATIO = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "uint8": 0.25, "onebit": 1 / 32}
"""Wire bytes per float32 byte (uint8 adds its per-chunk min and max, negligible at these sizes)."""
