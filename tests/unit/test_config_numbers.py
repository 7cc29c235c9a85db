"""Numbers in a config: finite, each timeout and interval in its stated range, and `workers.max`
capped and checked without memory proportional to it. Each is refused at load, in one line naming the
key, rather than failing (or spinning) in every worker later."""
from __future__ import annotations

import tracemalloc

import pytest
import yaml

from core.schema import ConfigError
from orchestrator.config import config_from_dict

MINIMAL = {"name": "n", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 3}}
LAB = {"network.nodes": 2, "network.workers_per_node": 1}


def refused(overrides: dict, base: dict = MINIMAL) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_dict(base, overrides)
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("key,value", [
    ("optimizer.lr", float("nan")), ("optimizer.lr", float("inf")), ("optimizer.momentum", float("nan")),
    ("optimizer.lr", "1e400"), pytest.param("optimizer.lr", 10 ** 400, id="optimizer.lr-10**400"), ("comm.timeout_s", float("inf")),
    ("workers.heartbeat_s", float("-inf")), ("workers.cpus", float("nan")), ("stop.time_s", float("nan")),
])
def test_non_finite_numbers_are_refused_naming_the_key(key, value):
    """YAML's `.nan`, `.inf` and `-.inf` (and 1e400, which reads as infinity) mean nothing any knob takes;
    NaN compares false with every bound, so a range check alone lets it through."""
    text = refused({key: value})
    assert text.startswith(f"{key}: must be a finite number"), text


def test_yaml_spellings_of_non_finite_numbers_are_refused():
    for spelling in (".nan", ".inf", "-.inf", ".NaN", "+.inf"):
        text = refused({}, {**MINIMAL, "optimizer": {"lr": 0.1, "momentum": yaml.safe_load(spelling)}})
        assert text.startswith("optimizer.momentum: must be a finite number"), (spelling, text)


@pytest.mark.parametrize("overrides,key,shown", [
    ({"comm.timeout_s": 1e300}, "comm.timeout_s", "[0.1, 86400] s, got 1e+300"),
    ({"comm.timeout_s": 0.01}, "comm.timeout_s", "got 0.01"),
    ({"workers.heartbeat_s": 1e-9}, "workers.heartbeat_s", "[0.1, 86400] s, got 1e-09"),
    ({"workers.heartbeat_s": 1e300}, "workers.heartbeat_s", "got 1e+300"),
    ({"workers.hang_timeout_s": 1e300}, "workers.hang_timeout_s", "got 1e+300"),
    ({"workers.start_grace_s": 0}, "workers.start_grace_s", "(0, 86400] s, got 0"),
    ({"workers.pause_after_s": 1e7}, "workers.pause_after_s", "got 1e+07"),
    ({"progress_every_s": -1}, "progress_every_s", "got -1"),
    ({"stop.time_s": 1e300}, "stop.time_s", "(0, 3.16224e+07] s"),
    ({"sync": {"policy": "shadow", "interval_s": 1e300}}, "sync.interval_s", "got 1e+300"),
    ({"faults.comm_latency_s": 1e300}, "faults.comm_latency_s", "got 1e+300"),
    ({"faults.checkpoint_store_s": 1e300}, "faults.checkpoint_store_s", "got 1e+300"),
    ({"faults.checkpoint_fail_s": 1e300}, "faults.checkpoint_fail_s", "got 1e+300"),
    ({"faults.stragglers": [{"slot": "w0", "delay_s": 1e300}]}, "faults.stragglers[0].delay_s", "got 1e+300"),
    ({**LAB, "network.inter": {"latency_ms": 1e300}}, "network.inter.latency_ms", "[0, 60000] ms"),
])
def test_timeouts_and_intervals_outside_their_range_are_refused(overrides, key, shown):
    """1e300 for `comm.timeout_s` used to pass and then raise OverflowError in every worker's constructor
    (a `timedelta`), the job bouncing between PAUSED and STARTING; 1e-9 for the heartbeat made the
    coordinator poll every 0.25 ns and evict healthy workers."""
    text = refused(overrides)
    assert text.startswith(f"{key}: must lie in") and shown in text, text


def test_the_ranges_own_ends_are_accepted():
    cfg = config_from_dict(MINIMAL, {"comm.timeout_s": 0.1, "workers.heartbeat_s": 0.1, "workers.hang_timeout_s": 86400,
                                     "progress_every_s": 0, "faults.comm_latency_s": 0})
    assert (cfg.comm.timeout_s, cfg.workers.heartbeat_s, cfg.workers.hang_timeout_s) == (0.1, 0.1, 86400.0)
    assert config_from_dict(MINIMAL, {"comm.timeout_s": 86400}).comm.timeout_s == 86400.0


@pytest.mark.parametrize("overrides,key", [
    ({"workers.max": 3_000_000}, "workers.max"),
    ({"workers.count": 20_000}, "workers.count"),
    ({"workers.spares": 10_001}, "workers.spares"),
])
def test_worker_counts_are_capped_with_the_reason(overrides, key):
    text = refused(overrides)
    assert text.startswith(f"{key}: at most 10000") and "Ray" in text, text


def test_fault_slots_are_checked_by_name_against_workers_max():
    base = {"workers.count": 2, "workers.max": 10_000}
    cfg = config_from_dict(MINIMAL, {**base, "faults.kills": [{"slot": "w9999", "step": 1}]})
    assert cfg.faults.kills[0].slot == "w9999"
    for slot in ("w10000", "w01", "w" + "9" * 5000):
        text = refused({**base, "faults.kills": [{"slot": slot, "step": 1}]})
        assert text.startswith("faults.kills[0].slot:") and "w0..w9999" in text, text


def test_validating_slots_takes_no_memory_per_slot():
    """Validating a fault's slot once built the set of every slot name (`workers.max: 3000000` took 4.6 s
    and 340 MiB); a slot is read from its name now, so a job of 10,000 slots validates in the memory of
    a job of 10."""
    def peak(workers_max: int) -> int:
        overrides = {"workers.count": 2, "workers.max": workers_max, "faults.kills": [{"slot": "w1", "step": 1}]}
        config_from_dict(MINIMAL, overrides)  # warm: imports and caches outside the measurement
        tracemalloc.start()
        try:
            config_from_dict(MINIMAL, overrides)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(10), peak(10_000)
    assert large - small < 100_000, (small, large)  # a set of 10,000 names is about 1 MB
