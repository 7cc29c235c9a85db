"""The coordinator's metrics (actors/observe/metrics.py) cost a few dictionary operations per record: what
records add reaches Ray's metrics once a second and at the job's end, summed."""
from __future__ import annotations

from actors.observe.metrics import Exporter, JobMetrics
from core.schema import Event
from testkit.fake_workers import FakeMetric


def test_records_are_summed_and_exported_once_a_tick_and_at_the_end():
    made: dict[str, FakeMetric] = {}
    calls = []

    def make(metric, defaults):
        made[metric.name] = m = FakeMetric(metric.kind)
        for verb in ("inc", "set", "observe"):
            original = getattr(m, verb)
            setattr(m, verb, lambda *a, _o=original, _v=verb, _n=metric.name, **k: (calls.append((_v, _n)), _o(*a, **k)))
        return m

    jm = JobMetrics(Exporter("j", "r", "dpsgd", make=make), "exchanges", lambda: 500, per_worker=True)
    for step in range(1, 501):
        for slot in ("w0", "w1"):
            jm.record({"step": step, "time": float(step), "loss": 1.0 / step, "world_size": 2, "membership_epoch": 1,
                       "slot": slot, "samples": 8, "bytes_sent": 100 * step})
    assert calls == [], "nothing reaches Ray per record"
    jm.tick(10.0, lambda: {"w0": 0.01, "w1": 0.03, "w2": 0.01}, {}, 0, now=100.0)
    assert made["member_steps"].values[()] == 1000 and made["samples"].values[()] == 8000
    assert made["committed_steps"].values[()] == 500, "the job's step: the slowest member's"
    assert made["bytes"].values[(("kind", "exchanges"),)] == 2 * 100 * 499
    assert made["loss"].values[()] == 1.0 / 500 and made["world_size"].values[()] == 2
    assert made["step_time_ratio"].values == {(("slot", "w0"),): 1.0, (("slot", "w1"),): 3.0, (("slot", "w2"),): 1.0}
    exported = len(calls)
    jm.record({"step": 501, "time": 501.0, "loss": 0.1, "slot": "w0", "samples": 8, "bytes_sent": 50100})
    jm.tick(10.0, dict, {}, 0, now=100.5)
    assert len(calls) == exported, "at most once a second"
    jm.event(Event(time=1.0, kind="transition", reason="done", state_from="RUNNING", state_to="FINISHED"))
    assert made["member_steps"].values[()] == 1001 and made["loss"].values[()] == 0.1, "flushed at the end"
