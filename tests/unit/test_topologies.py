"""Topologies: every W doubly stochastic (symmetric where claimed) for worlds 2..16 over a full period,
rows from `peers` equal to `matrix`, pairings mutual, gaps positive, and plain-numpy references for
the rules the module states (ring, complete, one-peer exponential, BAGUA's shift_one,
the mean of random matchings). A gossip step x <- W x keeps the average and shrinks the consensus
distance at least by the factor W's second eigenvalue (singular value) predicts."""
from __future__ import annotations

import numpy as np
import pytest

from algorithms.policies.gossip import consensus_distance as consensus
from algorithms.rules.topologies import TOPOLOGIES, Topology, TopologyError, contraction, degree, get_topology, spectral_gap, validate
from core.schema import ConfigError

WORLDS = range(2, 17)
CASES = [get_topology(kind) for kind in sorted(TOPOLOGIES)] + [
    get_topology("aer", per_node=2), get_topology("aer", per_node=3), get_topology("matching", seed=7)]
IDS = [f"{t.name}{'' if t == type(t)() else '-' + repr(t)}" for t in CASES]


def steps(topology: Topology, world: int) -> range:
    """A full period for time-varying topologies, a few draws for random ones, two steps otherwise."""
    if topology.random:
        return range(6)
    return range(topology.period(world)) if topology.time_varying else range(0, 10, 9)


def each(topology: Topology):
    for world in WORLDS:
        for step in steps(topology, world):
            yield world, step, topology.matrix(world, step)


def shift(world: int, by: int) -> np.ndarray:
    """P with P[i, (i + by) mod n] = 1: row i reads rank i + by."""
    return np.roll(np.eye(world), by, axis=1)


# --------------------------------------------------------------------------- every topology
@pytest.mark.parametrize("topology", CASES, ids=IDS)
def test_doubly_stochastic_and_symmetric_where_claimed(topology):
    for world, step, w in each(topology):
        where = f"{topology} world {world} step {step}"
        assert w.shape == (world, world) and (w >= 0).all(), where
        assert np.abs(w.sum(axis=1) - 1).max() <= 1e-12, where
        assert np.abs(w.sum(axis=0) - 1).max() <= 1e-12, where
        if topology.is_symmetric:
            assert np.array_equal(w, w.T), where
        validate(w, topology.is_symmetric)


@pytest.mark.parametrize("topology", CASES, ids=IDS)
def test_peers_are_the_rows_of_the_matrix(topology):
    for world, step, w in each(topology):
        for rank in range(world):
            row = topology.peers(rank, world, step)
            ranks = [peer for peer, _ in row]
            assert ranks == sorted(set(ranks)) and rank in ranks, (world, step, row)
            assert all(weight > 0 for _, weight in row)
            assert dict(row) == {j: w[rank, j] for j in np.flatnonzero(w[rank])}, (world, step, rank)
            assert topology.sends_to(rank, world, step) == [j for j in np.flatnonzero(w[:, rank]) if j != rank]


@pytest.mark.parametrize("topology", [t for t in CASES if t.name in ("matching", "shift_one", "one_peer_exp", "aer")],
                         ids=lambda t: repr(t))
def test_one_peer_topologies_pair_up(topology):
    """Pairwise ones (matching, shift_one): my peer's peer is me. One-peer ones (one_peer_exp, the
    inter-node steps of aer): each rank reads one other rank and is read by one (a permutation)."""
    for world, step, w in each(topology):
        off = (w - np.diag(np.diag(w))) > 0
        reads, read_by = off.sum(axis=1), off.sum(axis=0)
        if topology.name == "aer" and reads.max() > 1:
            continue  # an intra-node step: the node averages as a block
        assert reads.max() <= 1 and read_by.max() <= 1, (world, step)
        assert np.array_equal(reads, read_by), (world, step)
        if topology.name in ("matching", "shift_one"):
            assert np.array_equal(off, off.T), (world, step)
            assert (reads == 0).sum() == world % 2, (world, step)
        if topology.name == "one_peer_exp":
            assert (reads == 1).all(), (world, step)


@pytest.mark.parametrize("topology", CASES, ids=IDS)
def test_connected_topologies_have_a_positive_gap(topology):
    assert spectral_gap(topology, 1) == 1.0
    assert topology.peers(0, 1, 3) == [(0, 1.0)]
    for world in WORLDS:
        gap = spectral_gap(topology, world)
        assert 0 < gap <= 1, (world, gap)


@pytest.mark.parametrize("topology", CASES, ids=IDS)
def test_check_accepts_every_period(topology):
    for world in WORLDS:
        topology.check(world)


def test_one_peer_exp_is_not_symmetric_beyond_two():
    topology = get_topology("one_peer_exp")
    assert not topology.is_symmetric
    for world in range(3, 17):
        w = topology.matrix(world, 0)
        assert not np.array_equal(w, w.T), world


# --------------------------------------------------------------------------- references
def test_complete_and_ring_match_their_formulas():
    for world in WORLDS:
        assert np.allclose(get_topology("complete").matrix(world), np.full((world, world), 1 / world), atol=0, rtol=1e-15)
        ring = get_topology("ring").matrix(world, 4)
        if world == 2:
            expected = np.full((2, 2), 0.5)
        else:
            expected = (np.eye(world) + shift(world, 1) + shift(world, -1)) / 3
        assert np.allclose(ring, expected, atol=1e-15), world
        lam2 = max(abs(1 + 2 * np.cos(2 * np.pi * k / world)) / 3 for k in range(1, world)) if world > 2 else 0.0
        assert spectral_gap(get_topology("ring"), world) == pytest.approx(1 - lam2, abs=1e-12)


def test_one_peer_exp_matches_its_formula_and_averages_exactly_on_powers_of_two():
    topology = get_topology("one_peer_exp")
    for world in WORLDS:
        tau = int(np.ceil(np.log2(world)))
        assert topology.period(world) == tau
        for step in range(2 * tau):
            expected = (np.eye(world) + shift(world, 2 ** (step % tau))) / 2
            assert np.allclose(topology.matrix(world, step), expected, atol=1e-15), (world, step)
        product, _ = topology.mixing_matrix(world)
        if world & (world - 1) == 0:
            assert np.abs(product - 1 / world).max() <= 1e-12
            assert spectral_gap(topology, world) == 1.0


def test_shift_one_follows_bagua_for_even_worlds():
    topology = get_topology("shift_one")
    for world in range(2, 17, 2):
        half = world // 2
        for s in range(2 * half):
            for r in range(world):
                partner = (s + r) % half + half if r < half else (r - half - s) % half
                assert topology.peers(r, world, s) == sorted([(r, 0.5), (partner, 0.5)]), (world, s, r)


def test_odd_shift_one_lets_every_rank_sit_out_in_turn():
    topology = get_topology("shift_one")
    for world in range(3, 17, 2):
        sat_out = [next(r for r in range(world) if topology.peers(r, world, s) == [(r, 1.0)])
                   for s in range(world)]
        assert sat_out == list(range(world))


def test_torus_shapes_and_prime_fallback_to_ring():
    from algorithms.rules.topologies import torus_shape
    assert [torus_shape(n) for n in (4, 6, 8, 9, 12, 16)] == [(2, 2), (2, 3), (2, 4), (3, 3), (3, 4), (4, 4)]
    torus, ring = get_topology("torus"), get_topology("ring")
    for prime in (2, 3, 5, 7, 11, 13):
        assert np.array_equal(torus.matrix(prime), ring.matrix(prime))
    assert degree(torus, 16) == 4 and degree(torus, 12) == 4 and degree(torus, 8) == 3


def test_exp_neighbours_are_the_powers_of_two_both_ways():
    topology = get_topology("exp")
    for world in WORLDS:
        around = {(sign * 2 ** k) % world for k in range(world.bit_length()) if 2 ** k < world for sign in (1, -1)} - {0}
        assert [p for p, _ in topology.peers(0, world)] == sorted(around | {0})


def test_aer_alternates_intra_and_inter_node_steps():
    topology = get_topology("aer", per_node=4)
    world = 16  # 4 nodes of 4: intra, hop 1 node, intra, hop 2 nodes
    assert topology.period(world) == 4
    assert topology.peers(5, world, 0) == [(4, 0.25), (5, 0.25), (6, 0.25), (7, 0.25)]
    assert topology.peers(5, world, 1) == [(5, 0.5), (9, 0.5)]
    assert topology.peers(5, world, 3) == [(5, 0.5), (13, 0.5)]
    assert spectral_gap(topology, world) == 1.0  # nodes a power of two: exact average per period
    assert np.array_equal(get_topology("aer").matrix(7, 2), get_topology("one_peer_exp").matrix(7, 2))
    assert np.array_equal(get_topology("aer", per_node=8).matrix(5, 1), get_topology("complete").matrix(5))


def test_matching_is_reproducible_and_its_mean_is_the_stated_expectation():
    topology = get_topology("matching", seed=3)
    assert np.array_equal(topology.matrix(8, 5), get_topology("matching", seed=3).matrix(8, 5))
    assert not all(np.array_equal(topology.matrix(8, s), topology.matrix(8, 0)) for s in range(1, 6))
    for world in (2, 3, 6, 9, 16):
        mean = sum(topology.matrix(world, s) for s in range(3000)) / 3000
        assert np.abs(mean - topology.expected_matrix(world)).max() < 0.02, world
        validate(topology.expected_matrix(world), symmetric=True)


# --------------------------------------------------------------------------- gossip
@pytest.mark.parametrize("topology", CASES, ids=IDS)
def test_gossip_keeps_the_average_and_contracts_as_predicted(topology):
    """With lr 0, x <- W x: the mean is unchanged (float64, 1e-12), and the consensus distance
    shrinks at least by lambda_2(W)^2 (symmetric W: the largest |eigenvalue| of W - J/n; otherwise
    the largest singular value), per step, and per period by the rho behind the spectral gap."""
    rng = np.random.default_rng(0)
    for world in WORLDS:
        x0 = rng.normal(size=(world, 5)) + 3.0
        x = x0
        for step in steps(topology, world):
            w = topology.matrix(world, step)
            dev = w - 1 / world
            lam = np.abs(np.linalg.eigvalsh(dev)).max() if topology.is_symmetric else np.linalg.norm(dev, 2)
            mixed = w @ x
            assert np.abs(mixed.mean(axis=0) - x.mean(axis=0)).max() <= 1e-12
            assert consensus(mixed) <= lam ** 2 * consensus(x) + 1e-12, (world, step)
            x = mixed
        if topology.time_varying:
            rho = (1 - spectral_gap(topology, world)) ** topology.period(world)
            assert consensus(x) <= rho ** 2 * consensus(x0) + 1e-12, world


def test_the_predicted_contraction_is_reached_by_the_slowest_direction():
    w = get_topology("ring").matrix(8)
    values, vectors = np.linalg.eigh(w - 1 / 8)
    slow = vectors[:, np.argmax(np.abs(values))][:, None]
    assert consensus(w @ slow) == pytest.approx(contraction(w) ** 2 * consensus(slow), rel=1e-12)


# --------------------------------------------------------------------------- registry and checks
def test_unknown_kind_names_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        get_topology("hypercube")
    message = str(err.value)
    assert "topology.kind" in message and "'hypercube'" in message
    assert all(kind in message for kind in TOPOLOGIES)
    with pytest.raises(ConfigError, match="per_node"):
        get_topology("aer", per_node=0)
    with pytest.raises(ConfigError, match="bad parameters"):
        get_topology("ring", seed=1)


def test_validate_rejects_what_is_not_a_mixing_matrix():
    with pytest.raises(TopologyError, match="row sums"):
        validate(np.array([[0.5, 0.4], [0.5, 0.6]]), symmetric=False)
    with pytest.raises(TopologyError, match="column sums"):
        validate(np.array([[0.5, 0.5], [1.0, 0.0]]), symmetric=False)
    with pytest.raises(TopologyError, match="negative"):
        validate(np.array([[1.5, -0.5], [-0.5, 1.5]]), symmetric=True)
    with pytest.raises(TopologyError, match="not symmetric"):
        validate(np.eye(3)[[1, 2, 0]], symmetric=True)
    validate(np.eye(3)[[1, 2, 0]], symmetric=False)


def test_long_period_gaps_agree_with_a_product_taken_on_the_disagreement_space():
    """rho = ||Pi W - J/n|| subtracts J/n from a product near it; over odd shift_one's long periods
    (n (n - 1) / 2 steps) it must agree with the product of W restricted to the space orthogonal to
    the ones vector, which never cancels."""
    topology = get_topology("shift_one")
    for world in (9, 11, 13, 15):
        basis = np.linalg.qr(np.column_stack([np.ones(world), np.eye(world)[:, 1:]]))[0][:, 1:]
        product = np.eye(world - 1)
        for step in range(topology.period(world)):
            product = basis.T @ topology.matrix(world, step) @ basis @ product
        assert contraction(topology.mixing_matrix(world)[0]) == pytest.approx(np.linalg.norm(product, 2), rel=1e-3)
