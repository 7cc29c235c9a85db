"""ZipLine's sweep against a brute-force search over every choice of one point per worker."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from algorithms.rules.zipline import Barrier, EwmaPredictor, place_barrier


def brute_force(last_end: np.ndarray, interval: np.ndarray, r: int) -> Barrier:
    """Every combination of one predicted point per worker: the smallest spread, the earliest end among
    those; then each worker's latest point not after that end (the sweep's choice)."""
    n = len(last_end)
    times = last_end[:, None] + interval[:, None] * np.arange(1, r + 1, dtype=np.float64)[None, :]
    best_spread, best_end = np.inf, np.inf
    for combo in itertools.product(range(r), repeat=n):
        chosen = times[np.arange(n), combo]
        spread = chosen.max() - chosen.min()
        if spread < best_spread or (spread == best_spread and chosen.max() < best_end):
            best_spread, best_end = spread, chosen.max()
    ks = tuple(int(np.flatnonzero(times[i] <= best_end).max()) + 1 for i in range(n))
    chosen = times[np.arange(n), np.array(ks) - 1]
    return Barrier(ks, float(chosen.min()), float(chosen.max()))


def instances(count: int, seed: int = 7):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n, r = int(rng.integers(1, 7)), int(rng.integers(1, 7))
        if n ** r > 50_000 and r ** n > 50_000:
            continue
        last_end = rng.uniform(0.0, 1.0, n)
        if rng.random() < 0.3:  # on a grid, so that equal times (ties) occur
            last_end, interval = rng.integers(0, 4, n).astype(float), rng.integers(1, 4, n).astype(float)
        else:
            interval = rng.uniform(0.05, 1.0, n) * rng.choice([1.0, 3.0], n)  # some 3x stragglers
        yield last_end, interval, r


def test_the_sweep_equals_brute_force_on_random_instances():
    checked = 0
    for last_end, interval, r in instances(260):
        expected = brute_force(last_end, interval, r)
        got = place_barrier(last_end, interval, r)
        assert got.spread == pytest.approx(expected.spread, abs=1e-12), (last_end, interval, r)
        assert got.end == expected.end and got.iterations == expected.iterations, (last_end, interval, r, got, expected)
        checked += 1
    print(f"zipline == brute force on {checked} instances (n <= 6, r <= 6)")
    assert checked >= 200


def test_r_1_synchronizes_after_every_iteration():
    barrier = place_barrier([0.0, 0.5, 0.1], [1.0, 3.0, 0.2], 1)
    assert barrier.iterations == (1, 1, 1) and barrier.end == 3.5


def test_a_3x_straggler_is_waited_for_once_every_three_fast_iterations():
    barrier = place_barrier([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 3.0], 8)
    assert barrier.iterations == (3, 3, 3, 1) and barrier.spread == 0.0


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        place_barrier([0.0, 1.0], [1.0], 4)
    with pytest.raises(ValueError):
        place_barrier([0.0], [0.0], 4)
    with pytest.raises(ValueError):
        place_barrier([0.0], [1.0], 0)


def test_1024_workers_lookahead_64_place_a_barrier_within_the_lookahead():
    """(How long it takes is a figure of benchmarks/zipline.py.)"""
    rng = np.random.default_rng(3)
    last_end, interval = rng.uniform(0, 1, 1024), rng.uniform(0.05, 0.5, 1024)
    barrier = place_barrier(last_end, interval, 64)
    assert all(1 <= k <= 64 for k in barrier.iterations)


def test_ewma_predictor_follows_a_worker_that_slows_down():
    predictor = EwmaPredictor(alpha=0.5)
    for interval in (1.0, 1.0, 3.0, 3.0, 3.0):
        predictor.observe("w0", interval)
    assert 2.5 < predictor.interval("w0") < 3.0
    predictor.forget("w0")
    with pytest.raises(KeyError):
        predictor.interval("w0")
