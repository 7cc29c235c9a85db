"""ZipLine: where ElasticBSP places its next barrier. Pure: numpy, no Ray, no torch.

Every time a barrier is passed, each worker's next `r` iteration end times are predicted as
t_i + k·Δ_i (k = 1..r), from its last end time t_i and its predicted iteration interval Δ_i (an
EWMA of its recent intervals by default; any `Predictor` fits). The barrier is the choice of one
predicted point per worker whose spread (latest minus earliest end time) is smallest: that is the
total time the workers would stand idle waiting for each other. Among windows of equal spread the
earliest wins. The result names, for each worker, after how many more iterations it synchronizes.

The sweep. Sort the n·r points by time. For a window ending at the point at position p, the best
choice for every worker is its latest point not after p (a later point would be outside the
window; an earlier one only widens it), so the window's start is the oldest of these "latest
points". Point j stays some worker's latest point from position j until that worker's next point,
E[j]; so the oldest latest point at p is the first j with E[j] > p, which is a binary search in the
running maximum of E. That makes the whole search a sort and two vectorized passes:
O(n·r·log(n·r)). Points at the same time are taken together (a window is evaluated only after the
last of them). `r: 1` gives every worker one iteration: a barrier after each step, which is BSP.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Barrier:
    """Where the next barrier goes."""

    iterations: tuple[int, ...]
    """For each worker (in the order given), after how many more iterations (1..r) it synchronizes."""
    start: float
    """The earliest predicted arrival at the barrier."""
    end: float
    """The latest predicted arrival: when the barrier is expected to open."""

    @property
    def spread(self) -> float:
        """The predicted wait of the first worker to arrive: the window's width."""
        return self.end - self.start


def place_barrier(last_end: Sequence[float], interval: Sequence[float], r: int) -> Barrier:
    """The barrier with the smallest spread (earliest on ties) among each worker's next `r`
    predicted iteration end times `last_end[i] + k * interval[i]`, k = 1..r."""
    t0 = np.asarray(last_end, dtype=np.float64)
    step = np.asarray(interval, dtype=np.float64)
    n = len(t0)
    if n == 0 or len(step) != n:
        raise ValueError(f"need one last end time and one interval per worker, got {n} and {len(step)}")
    if r < 1:
        raise ValueError(f"r (lookahead) must be >= 1, got {r}")
    if not np.all(step > 0) or not np.all(np.isfinite(step)) or not np.all(np.isfinite(t0)):
        raise ValueError("intervals must be positive and finite, end times finite")
    if r == 1:
        return Barrier((1,) * n, float((t0 + step).min()), float((t0 + step).max()))
    ks = np.arange(1, r + 1, dtype=np.float64)
    times = (t0[:, None] + step[:, None] * ks[None, :]).ravel()  # worker-major: point w*r + (k-1)
    worker = np.repeat(np.arange(n), r)
    order = np.lexsort((np.tile(np.arange(r), n), worker, times))  # by time; ties by worker, then k
    t = times[order]
    size = n * r
    position = np.empty(size, dtype=np.int64)
    position[order] = np.arange(size)
    # E[j]: where the next point of the same worker sits (k+1 follows k in time), or past the end.
    following = np.full(size, size, dtype=np.int64)
    by_worker = position.reshape(n, r)
    following_by_worker = np.concatenate([by_worker[:, 1:], np.full((n, 1), size, dtype=np.int64)], axis=1)
    following[by_worker.ravel()] = following_by_worker.ravel()
    oldest_latest = np.searchsorted(np.maximum.accumulate(following), np.arange(size), side="right")
    # Windows end after the last point of a group of equal times, once every worker has a point.
    first_full = int(by_worker[:, 0].max())
    ends = np.flatnonzero(np.append(t[1:] != t[:-1], True))
    ends = ends[ends >= first_full]
    spreads = t[ends] - t[oldest_latest[ends]]
    best = int(ends[int(np.argmin(spreads))])  # argmin takes the first: the earliest window on ties
    # Each worker's latest point at or before the window's end.
    latest = np.zeros(n, dtype=np.int64)
    upto = order[: best + 1]
    np.maximum.at(latest, worker[upto], upto % r + 1)
    return Barrier(tuple(int(k) for k in latest), float(t[oldest_latest[best]]), float(t[best]))


class Predictor(Protocol):
    """Predicts each worker's next iteration interval from the ones it reported."""

    def observe(self, worker: str, interval: float) -> None: ...

    def interval(self, worker: str) -> float: ...


class EwmaPredictor:
    """Exponentially weighted moving average of each worker's iteration intervals. The authors'
    exact predictor is not public; this is the standard stand-in, and `Predictor` lets it be swapped."""

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._mean: dict[str, float] = {}

    def observe(self, worker: str, interval: float) -> None:
        if interval <= 0:
            return  # a clock that did not move says nothing about speed
        previous = self._mean.get(worker)
        self._mean[worker] = interval if previous is None else previous + self.alpha * (interval - previous)

    def interval(self, worker: str) -> float:
        if worker not in self._mean:
            raise KeyError(f"no interval observed for worker {worker!r}")
        return self._mean[worker]

    def forget(self, worker: str) -> None:
        """A departed worker's history goes with it."""
        self._mean.pop(worker, None)


class BarrierPlanner:
    """The coordinator's side of elastic_bsp: a predictor of each member's iteration interval, fed with
    the intervals the server measured over each round, and ZipLine once per barrier for the next."""

    def __init__(self, r: int, alpha: float = 0.3, predictor: Predictor | None = None) -> None:
        self.r = r
        self.predictor = predictor or EwmaPredictor(alpha)

    def plan(self, members: Sequence[str], intervals: Mapping[str, Sequence[float]]) -> dict[str, int] | None:
        """After how many iterations (1..r) each of `members` synchronizes next, all starting now; None
        when a member has no interval to predict from yet (a joiner: the server's fallback holds)."""
        for slot, seen in intervals.items():
            for interval in seen:
                self.predictor.observe(slot, interval)
        try:
            steps = [self.predictor.interval(slot) for slot in members]
        except KeyError:
            return None
        barrier = place_barrier([0.0] * len(members), steps, self.r)
        return dict(zip(members, barrier.iterations))
