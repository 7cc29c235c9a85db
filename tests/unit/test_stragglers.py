"""The straggler watch (pure) and the straggler fault's seeded jitter."""
from __future__ import annotations

import statistics

import numpy as np
import pytest

from actors.faults import WorkerFaults, jitter_factor
from algorithms.rules.stragglers import StragglerChange, StragglerWatch
from core.schema import FaultsConfig, JitterSpec, StragglerFault


def test_a_3x_member_is_named_with_its_ratio_and_released_with_hysteresis():
    watch = StragglerWatch(threshold=1.5, release=0.9)
    assert watch.update({"w0": 0.01, "w1": 0.01, "w2": 0.01, "w3": 0.03}) == [StragglerChange("w3", True, 3.0)]
    assert watch.current == {"w3": 3.0}
    assert watch.update({"w0": 0.01, "w1": 0.01, "w2": 0.01, "w3": 0.014}) == []  # 1.4 >= 1.35: still one
    assert watch.update({"w0": 0.01, "w1": 0.01, "w2": 0.01, "w3": 0.013}) == [StragglerChange("w3", False, pytest.approx(1.3))]
    assert watch.update({"w0": 0.01, "w1": 0.01, "w2": 0.01, "w3": 0.014}) == []  # 1.4 <= 1.5: not again


def test_a_departed_straggler_is_released_and_a_lone_member_is_never_one():
    watch = StragglerWatch()
    watch.update({"w0": 0.01, "w1": 0.01, "w2": 0.05})
    assert watch.update({"w0": 0.01, "w1": 0.01}) == [StragglerChange("w2", False, 0.0)]
    assert watch.update({"w0": 0.5}) == [] and watch.current == {}
    # w1 has no estimate yet: the median is over w0 and w2 alone
    assert watch.update({"w0": 0.01, "w1": 0.0, "w2": 0.05}) == [StragglerChange("w2", True, pytest.approx(5 / 3))]


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError):
        StragglerWatch(threshold=1.0)
    with pytest.raises(ValueError):
        StragglerWatch(release=0.0)


def test_jitter_is_lognormal_with_median_one_and_the_same_on_every_run():
    factors = [jitter_factor(0.5, 7, "w2", step) for step in range(4000)]
    assert factors[:5] == [jitter_factor(0.5, 7, "w2", step) for step in range(5)]
    assert abs(statistics.median(factors) - 1.0) < 0.05
    assert abs(np.std(np.log(factors)) - 0.5) < 0.03
    assert jitter_factor(0.5, 7, "w1", 3) != jitter_factor(0.5, 7, "w2", 3)


class Clock:
    """A test's own time: it moves only by what the code under test sleeps, or what the test says."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def faults_on(cfg: FaultsConfig, slot: str, clock: Clock) -> WorkerFaults:
    return WorkerFaults(cfg, slot, record=lambda *a: None, clock=clock, sleep=clock.sleep)


def test_a_straggler_sleeps_its_modelled_time_and_says_how_long():
    """A step that computed 0.01 s: slowdown 3 makes it 0.03 s, plus delay_s, times the jitter factor."""
    cfg = FaultsConfig(stragglers=[StragglerFault(slot="w1", slowdown=3.0, delay_s=0.02,
                                                  jitter=JitterSpec(sigma=0.5, seed=1))])
    clock = Clock()
    started = clock.now
    clock.now += 0.01  # the step's own compute
    slept = faults_on(cfg, "w1", clock).straggle(started, step=4)
    expected = (0.01 * 3.0 + 0.02) * jitter_factor(0.5, 1, "w1", 4) - 0.01
    assert slept == pytest.approx(expected, rel=1e-12) and clock.slept == [slept]
    assert faults_on(cfg, "w0", Clock()).straggle(started, 4) == 0.0


def test_a_straggler_from_a_step_on_is_slow_only_from_there_and_entries_combine():
    cfg = FaultsConfig(stragglers=[StragglerFault(slot="w1", delay_s=0.01),
                                   StragglerFault(slot="w1", delay_s=0.05, from_step=10)])
    clock = Clock()
    faults = faults_on(cfg, "w1", clock)
    assert faults.straggle(clock.now, 9) == pytest.approx(0.01, rel=1e-12)
    assert faults.straggle(clock.now, 10) == pytest.approx(0.05, rel=1e-12)
    late = faults_on(FaultsConfig(stragglers=[StragglerFault(slot="w1", delay_s=0.05, from_step=3)]), "w1", clock)
    assert late.straggle(clock.now, 2) == 0.0 and late.straggle(clock.now, 3) == pytest.approx(0.05, rel=1e-12)
