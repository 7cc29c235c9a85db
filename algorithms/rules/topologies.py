"""Gossip topologies: who mixes with whom, and with what weight. Pure: numpy, no Ray, no torch.

A topology answers `peers(rank, world, step) -> [(peer, weight)]`: row `rank` of the mixing
matrix W used at exchange `step`, so that x_rank <- sum(weight * x_peer). The list includes the
rank itself with its self-weight, names each peer once, holds only positive weights and is
sorted by peer; its weights sum to 1. `matrix(world, step)` is the literal W, built from those
rows; `sends_to(rank, world, step)` is its column (whom `rank` must send to, which differs from
the peers it receives from only when W is not symmetric). Every W is doubly stochastic, so a
gossip step x <- W x keeps the average of the replicas; `validate` checks it (and symmetry
where a topology claims it), and a caller recomputes the topology for every membership epoch,
since ranks and the world size change with it.

Static topologies (`complete`, `ring`, `torus`, `exp`) are symmetric graphs in which every rank
has the same number d of distinct neighbours; each neighbour and the rank itself get 1/(d+1).
Time-varying ones (`one_peer_exp`, `aer`, `shift_one`) repeat after `period(world)` steps;
`matching` draws a fresh pairing at each step from its seed (period 1, random).

Expected mixing (`spectral_gap`): with M = E[W] for static and random topologies, or M = the
product W_{p-1} ... W_1 W_0 over one period p starting at step 0 for time-varying ones, and
rho = ||M - J/n||_2 (the largest singular value of M on the space orthogonal to the all-ones
vector; for a symmetric M it is |lambda_2(M)|), the gap is 1 - rho^(1/p): a per-step equivalent
contraction of the disagreement (in float64: a product that is the exact average with dyadic
weights gives rho = 0 and gap 1; rounding puts a floor near 1e-16 under rho, so over a long period,
such as odd `shift_one`, the gap is trustworthy while rho stays well above it, true for n <= 16
where the smallest rho is 4e-14 at n = 15). For a doubly stochastic W, one step gives
||W x - xbar|| <= ||W - J/n||_2 ||x - xbar||, so the consensus distance shrinks at least by
rho^2 per step (static) or per period (time-varying). A disconnected topology has gap 0.

Small and awkward world sizes, per topology (each docstring says more):
- world 1: every topology is the rank alone, weight 1 (period 1).
- world 2: every topology averages the pair (w = 1/2) at every step.
- odd worlds: `matching` and `shift_one` leave one rank out per step (self-weight 1), chosen so
  that every rank sits out in turn; the pairwise steps of the rest stay mutual.
- primes: `torus` has no 2-D factorisation and is the 1 x n torus, i.e. the ring.
- non-powers of two: `exp` and `one_peer_exp` use distances 2^k < n (wrapping mod n); the
  one-peer product over a period is then near, not exactly, the average.
"""
from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from core.schema import ConfigError, OrchestratorError

Row = list[tuple[int, float]]


class TopologyError(OrchestratorError):
    """A mixing matrix that is not doubly stochastic (or not symmetric where it should be)."""


# --------------------------------------------------------------------------- helpers
def _check(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank {rank} in world {world}")


def _uniform(rank: int, neighbours: set[int]) -> Row:
    """The rank and its distinct neighbours, each with 1/(d+1)."""
    members = sorted(neighbours | {rank})
    return [(peer, 1.0 / len(members)) for peer in members]


def _pair(rank: int, partner: int) -> Row:
    """Average with `partner` (w = 1/2), or keep one's own replica when there is none."""
    if partner == rank:
        return [(rank, 1.0)]
    return sorted([(rank, 0.5), (partner, 0.5)])


def _distances(world: int) -> list[int]:
    """Powers of two below `world`: 1, 2, 4, ..., 2^(ceil(log2 world) - 1)."""
    return [1 << k for k in range(_log2_ceil(world))]


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


# --------------------------------------------------------------------------- interface
class Topology(ABC):
    """A rule for mixing matrices. Subclasses give `peers`; the rest follows from it."""

    name: ClassVar[str]
    is_symmetric: ClassVar[bool] = True
    """W equals its transpose at every step (peers and receivers are the same ranks)."""
    time_varying: ClassVar[bool] = False
    random: ClassVar[bool] = False
    """W is drawn at each step (from the topology's seed); `expected_matrix` is its mean."""

    @abstractmethod
    def peers(self, rank: int, world: int, step: int = 0) -> Row:
        """Row `rank` of W at `step`: [(peer, weight)], self included, sorted, weights sum to 1."""

    def period(self, world: int) -> int:
        """After how many steps W repeats (1 for static and for random topologies)."""
        return 1

    def matrix(self, world: int, step: int = 0) -> np.ndarray:
        """The literal W (float64, world x world) at `step`."""
        w = np.zeros((world, world))
        for rank in range(world):
            for peer, weight in self.peers(rank, world, step):
                w[rank, peer] = weight
        return w

    def sends_to(self, rank: int, world: int, step: int = 0) -> list[int]:
        """The other ranks whose row holds `rank` at `step`: where `rank`'s replica must go."""
        column = self.matrix(world, step)[:, rank]
        return [int(j) for j in np.flatnonzero(column) if j != rank]

    def expected_matrix(self, world: int) -> np.ndarray:
        """E[W]: the mean of W over one period (or, for random topologies, over the draws)."""
        p = self.period(world)
        mean = sum(self.matrix(world, s) for s in range(p)) / p
        assert isinstance(mean, np.ndarray)  # p >= 1: the sum holds at least one matrix
        return mean

    def check(self, world: int) -> None:
        """Validate W at every step of one period (a random topology: its first draw); raises
        TopologyError. Run it when a membership epoch recomputes the topology."""
        for step in range(self.period(world)):
            validate(self.matrix(world, step), self.is_symmetric)

    def mixing_matrix(self, world: int) -> tuple[np.ndarray, int]:
        """(M, steps) whose gap `spectral_gap` reports: E[W] for static and random topologies
        (steps 1), the product W_{p-1} ... W_0 over one period p for time-varying ones."""
        if not self.time_varying:
            return self.expected_matrix(world), 1
        product = np.eye(world)
        for s in range(self.period(world)):
            product = self.matrix(world, s) @ product
        return product, self.period(world)


def validate(w: np.ndarray, symmetric: bool, atol: float = 1e-12) -> None:
    """Raise TopologyError unless W is nonnegative, doubly stochastic (and symmetric if asked)."""
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise TopologyError(f"a mixing matrix is square, got shape {w.shape}")
    problems = []
    if (w < 0).any():
        problems.append(f"negative entries (min {w.min():.3g})")
    for axis, what in ((1, "row"), (0, "column")):
        worst = np.abs(w.sum(axis=axis) - 1.0).max()
        if worst > atol:
            problems.append(f"{what} sums off 1 by up to {worst:.3g}")
    if symmetric and np.abs(w - w.T).max() > atol:
        problems.append(f"not symmetric (max |W - W^T| {np.abs(w - w.T).max():.3g})")
    if problems:
        raise TopologyError("mixing matrix is not valid: " + "; ".join(problems))


def contraction(m: np.ndarray) -> float:
    """||M - J/n||_2: the factor by which M shrinks the worst disagreement (0 for world 1)."""
    n = m.shape[0]
    return float(np.linalg.norm(m - np.full((n, n), 1.0 / n), ord=2)) if n > 1 else 0.0


def spectral_gap(topology: Topology, world: int) -> float:
    """1 - rho^(1/steps) for (M, steps) = `topology.mixing_matrix(world)`, rho = ||M - J/n||_2:
    1 - |lambda_2(E[W])| for symmetric static and random topologies, the per-step equivalent of
    the product over a period for time-varying ones (see the module docstring). 1 for world 1."""
    m, steps = topology.mixing_matrix(world)
    return 1.0 - min(contraction(m), 1.0) ** (1.0 / steps)


@functools.lru_cache(maxsize=64)
def _gap(kind: str, params: tuple, world: int) -> float:
    return spectral_gap(get_topology(kind, **dict(params)), world)


def topology_status(config, plan) -> dict:
    """A gossip policy's topology (`config`: its `sync.topology`, or None) over the plan's members,
    with its spectral gap there, for status; {} for the other policies."""
    if config is None or plan is None:
        return {}
    n = len(plan.members)
    gap = _gap(config.kind, tuple(sorted(config.params().items())), n)
    return {"kind": config.kind, "world_size": n, "spectral_gap": round(gap, 6)}


def degree(topology: Topology, world: int) -> int:
    """The most other ranks any rank mixes with in one step (over a period)."""
    return max(len(topology.peers(r, world, s)) - 1
               for s in range(topology.period(world)) for r in range(world))


# --------------------------------------------------------------------------- static
@dataclass(frozen=True)
class Complete(Topology):
    """Everyone with everyone, w = 1/n: one exchange is the exact average (an all-reduce)."""

    name: ClassVar[str] = "complete"

    def peers(self, rank: int, world: int, step: int = 0) -> Row:
        _check(rank, world)
        return [(peer, 1.0 / world) for peer in range(world)]


@dataclass(frozen=True)
class Ring(Topology):
    """Left and right neighbour and self, w = 1/3 each (n >= 3). World 2: the two neighbours are the
    same rank, so the pair averages (w = 1/2), which is `complete`; world 1: self alone."""

    name: ClassVar[str] = "ring"

    def peers(self, rank: int, world: int, step: int = 0) -> Row:
        _check(rank, world)
        return _uniform(rank, {(rank - 1) % world, (rank + 1) % world} - {rank})


def torus_shape(world: int) -> tuple[int, int]:
    """(rows, cols) with rows * cols = world and rows the largest divisor <= sqrt(world): as square
    as the world allows (16 -> 4 x 4, 12 -> 3 x 4, 8 -> 2 x 4, a prime p -> 1 x p)."""
    rows = max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
    return rows, world // rows


@dataclass(frozen=True)
class Torus(Topology):
    """2-D torus of shape `torus_shape(world)`, rank = row * cols + col; neighbours one step up,
    down, left and right (wrapping), each distinct neighbour and self w = 1/(d+1). Where a side is
    2 its two directions coincide (d = 3, or d = 2 for the 2 x 2 torus, which is the 4-ring); where
    it is 1 it adds nothing: a prime world is the 1 x n torus, i.e. the ring."""

    name: ClassVar[str] = "torus"

    def peers(self, rank: int, world: int, step: int = 0) -> Row:
        _check(rank, world)
        rows, cols = torus_shape(world)
        r, c = divmod(rank, cols)
        around = {((r + dr) % rows) * cols + (c + dc) % cols for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))}
        return _uniform(rank, around - {rank})


@dataclass(frozen=True)
class Exp(Topology):
    """Static exponential graph, made symmetric: neighbours at ring distances +-2^k for every
    2^k < n (mod n), each distinct neighbour and self w = 1/(d+1). For a power of two n,
    d = 2 log2(n) - 1 (+-n/2 coincide); otherwise the set is taken mod n with duplicates merged
    (so n <= 4 gives `complete`)."""

    name: ClassVar[str] = "exp"

    def peers(self, rank: int, world: int, step: int = 0) -> Row:
        _check(rank, world)
        around = {(rank + sign * d) % world for d in _distances(world) for sign in (1, -1)}
        return _uniform(rank, around - {rank})


# --------------------------------------------------------------------------- time-varying
@dataclass(frozen=True)
class OnePeerExp(Topology):
    """One-peer exponential graph: at step t, rank i averages with (i + 2^(t mod tau)) mod n, where
    tau = ceil(log2 n), w = 1/2; it receives from that peer and sends to (i - 2^k) mod n, so W is a
    permutation mixed with I (doubly stochastic) and is not symmetric unless 2^k = n/2. Period tau.
    For n a power of two the product over a period is exactly J/n (gap 1); otherwise it is the mean
    of the shifts 0 .. 2^tau - 1 taken mod n, near the average. Worlds 1 and 2: self alone; the pair."""

    name: ClassVar[str] = "one_peer_exp"
    is_symmetric: ClassVar[bool] = False
    time_varying: ClassVar[bool] = True

    def period(self, world: int) -> int:
        return max(1, _log2_ceil(world))

    def peers(self, rank: int, world: int, step: int = 0) -> Row:
        _check(rank, world)
        if world == 1:
            return [(0, 1.0)]
        return _pair(rank, (rank + (1 << (step % self.period(world)))) % world)


@dataclass(frozen=True)
class Aer(Topology):
    """Alternating exponential ring across nodes (this project's rule). Rank r lives on node
    r // per_node; N = ceil(n / per_node) nodes (the last one may hold fewer ranks). Steps
    alternate between two phases:

    - intra-node (even steps): the ranks of each node average among themselves (w = 1/size);
    - inter-node (odd steps): a one-peer exponential step across nodes: rank r receives from
      (r + per_node * 2^k) mod n with w = 1/2, k = (t // 2) mod ceil(log2 N), i.e. the same local
      slot on the node 2^k further along the ring of nodes (with a short last node the shift still
      wraps mod n, so W stays a permutation mixed with I, doubly stochastic, not symmetric).

    A phase with nothing to do is dropped: with per_node = 1 (the default) every step is
    inter-node and `aer` is `one_peer_exp`; with one node (N = 1) every step is intra-node and it
    is `complete`. Period 2 ceil(log2 N), or the period of the one phase left."""

    name: ClassVar[str] = "aer"
    is_symmetric: ClassVar[bool] = False
    time_varying: ClassVar[bool] = True
    per_node: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.per_node, int) or self.per_node < 1:
            raise ConfigError(f"topology.per_node must be an integer >= 1, got {self.per_node!r}")

    def _phases(self, world: int) -> tuple[bool, int]:
        """(whether there is an intra-node phase, the number of inter-node distances)."""
        nodes = -(-world // self.per_node)
        return self.per_node > 1 and world > 1, _log2_ceil(nodes)

    def period(self, world: int) -> int:
        intra, hops = self._phases(world)
        return max(1, hops * (2 if intra else 1)) if hops else 1

    def peers(self, rank: int, world: int, step: int = 0) -> Row:
        _check(rank, world)
        intra, hops = self._phases(world)
        if intra and (hops == 0 or step % 2 == 0):
            start = rank - rank % self.per_node
            node = range(start, min(start + self.per_node, world))
            return [(peer, 1.0 / len(node)) for peer in node]
        if hops == 0:
            return [(rank, 1.0)]
        k = (step // 2 if intra else step) % hops
        return _pair(rank, (rank + self.per_node * (1 << k)) % world)


def _shift_one_partner(position: int, half: int, step: int) -> int:
    """BAGUA's shift_one on 2 * half positions: p < half pairs with (s + p) mod half + half, and
    p >= half with (p - half - s) mod half (the two rules are each other's inverse)."""
    if position < half:
        return (step + position) % half + half
    return (position - half - step) % half


@dataclass(frozen=True)
class ShiftOne(Topology):
    """BAGUA's shift_one: ranks split in halves (h = n/2); at exchange s, rank r < h pairs with
    (s + r) mod h + h and rank r >= h with (r - h - s) mod h; pairs average (w = 1/2). Period h.
    Odd n: at exchange s rank c = s mod n sits out (self-weight 1), and the others, taken in ring
    order after it (rank (c + 1 + q) mod n at position q), run shift_one on n - 1 positions with
    h = (n - 1) / 2; every rank sits out in turn. Period lcm(n, h) = n (n - 1) / 2. World 1: self."""

    name: ClassVar[str] = "shift_one"
    time_varying: ClassVar[bool] = True

    def period(self, world: int) -> int:
        if world % 2 == 0:
            return world // 2
        return math.lcm(world, world // 2) if world > 1 else 1

    def peers(self, rank: int, world: int, step: int = 0) -> Row:
        _check(rank, world)
        if world % 2 == 0:
            return _pair(rank, _shift_one_partner(rank, world // 2, step))
        if world == 1 or rank == step % world:
            return [(rank, 1.0)]
        out = step % world
        position = (rank - out - 1) % world
        partner = _shift_one_partner(position, world // 2, step)
        return _pair(rank, (out + 1 + partner) % world)


# --------------------------------------------------------------------------- random
@dataclass(frozen=True)
class Matching(Topology):
    """A uniformly random perfect matching at each step, pairs average (w = 1/2). The pairing is a
    pure function of (seed, world, step), so every member computes the same one without talking:
    ranks are ordered by keys from numpy's SeedSequence (a fixed hash, stable across numpy
    versions), and consecutive ranks in that order pair up. Odd n: the last rank in the order sits
    out with self-weight 1 (uniformly, so every rank sits out now and then). E[W] has 1/2 on the
    diagonal and 1/(2(n-1)) elsewhere for even n; 1/n + (n-1)/(2n) and 1/(2n) for odd n."""

    name: ClassVar[str] = "matching"
    random: ClassVar[bool] = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"topology.seed must be an integer >= 0, got {self.seed!r}")

    def order(self, world: int, step: int) -> np.ndarray:
        """The ranks in this step's random order (pairs are consecutive)."""
        keys = np.random.SeedSequence([self.seed, world, step]).generate_state(world, np.uint64)
        return np.argsort(keys, kind="stable")

    def peers(self, rank: int, world: int, step: int = 0) -> Row:
        _check(rank, world)
        order = self.order(world, step)
        at = int(np.flatnonzero(order == rank)[0])
        if at == world - 1 and world % 2 == 1:
            return [(rank, 1.0)]
        return _pair(rank, int(order[at ^ 1]))

    def matrix(self, world: int, step: int = 0) -> np.ndarray:
        # One draw for the whole matrix instead of one per row.
        order = self.order(world, step)
        w = np.eye(world)
        for a, b in zip(order[0:world - 1:2], order[1::2]):
            w[[a, a, b, b], [a, b, a, b]] = 0.5
        return w

    def expected_matrix(self, world: int) -> np.ndarray:
        if world == 1:
            return np.ones((1, 1))
        off = 1.0 / (2 * (world - 1)) if world % 2 == 0 else 1.0 / (2 * world)
        e = np.full((world, world), off)
        np.fill_diagonal(e, 1.0 - off * (world - 1))
        return e


# --------------------------------------------------------------------------- registry
TOPOLOGIES: dict[str, type[Topology]] = {cls.name: cls for cls in (
    Complete, Ring, Torus, Exp, OnePeerExp, Aer, Matching, ShiftOne)}


def get_topology(kind: str, **params) -> Topology:
    """The topology `kind` with its parameters (`aer`: per_node; `matching`: seed)."""
    if kind not in TOPOLOGIES:
        raise ConfigError(f"topology.kind: unknown topology {kind!r}; valid kinds: {', '.join(sorted(TOPOLOGIES))}")
    try:
        return TOPOLOGIES[kind](**params)
    except TypeError as exc:
        raise ConfigError(f"topology: bad parameters {sorted(params)} for {kind!r} ({exc})") from None
