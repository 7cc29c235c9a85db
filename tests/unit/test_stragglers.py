"""The straggler watch (pure) and the straggler fault's seeded jitter."""
from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

from actors.faults import WorkerFaults, jitter_factor
from algorithms.stragglers import StragglerChange, StragglerWatch
from core.schema import FaultsConfig, JitterSpec, StragglerFault

pytestmark = pytest.mark.exclusive  # it measures times: it runs alone (tests/conftest.py)


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


def test_a_straggler_sleeps_its_modelled_time_and_says_how_long():
    cfg = FaultsConfig(stragglers=[StragglerFault(slot="w1", delay_s=0.02, jitter=JitterSpec(sigma=0.5, seed=1))])
    faults = WorkerFaults(cfg, "w1", record=lambda *a: None)
    started = time.perf_counter()
    slept = faults.straggle(started, step=4)
    took = time.perf_counter() - started
    expected = 0.02 * jitter_factor(0.5, 1, "w1", 4)
    assert slept == pytest.approx(expected, abs=2e-3) and took >= slept
    assert WorkerFaults(cfg, "w0", record=lambda *a: None).straggle(time.perf_counter(), 4) == 0.0


def test_a_straggler_from_a_step_on_is_slow_only_from_there_and_entries_combine():
    cfg = FaultsConfig(stragglers=[StragglerFault(slot="w1", delay_s=0.01),
                                   StragglerFault(slot="w1", delay_s=0.05, from_step=10)])
    faults = WorkerFaults(cfg, "w1", record=lambda *a: None)
    assert faults.straggle(time.perf_counter(), 9) == pytest.approx(0.01, abs=3e-3)
    assert faults.straggle(time.perf_counter(), 10) == pytest.approx(0.05, abs=3e-3)
    late = WorkerFaults(FaultsConfig(stragglers=[StragglerFault(slot="w1", delay_s=0.05, from_step=3)]), "w1",
                        record=lambda *a: None)
    assert late.straggle(time.perf_counter(), 2) == 0.0 and late.straggle(time.perf_counter(), 3) > 0.04
